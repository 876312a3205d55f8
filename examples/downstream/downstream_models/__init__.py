"""The downstream example's additions to the precision matrix: importing this package registers
its model kind (bag-classifier) and adds its known-failure catalogue to the built-in one."""

from pathlib import Path

from downstream_models import bag_classifier  # noqa: F401  (registers the kind on import)
from matrix import catalogue

CATALOGUE = catalogue.register(Path(__file__).with_name("known_failures.toml"))
