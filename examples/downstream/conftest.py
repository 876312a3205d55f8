# The matrix's pytest plugin is loaded through its entry point; importing the package here
# registers this project's model kind and catalogue before the plugin selects cells.
import downstream_models  # noqa: F401
