"""Version stacks: the shipped file parses; malformed stacks name the file, stack and field."""

import pytest

from matrix.releases import stacks

GOOD = """
[stack.default]
description = "today"

[stack.old]
description = "an old stack"
pins = ["transformers==4.50.0", "accelerate>=1.5,<1.6"]
select = ["--model", "gemma-cache"]
requires = ["cuda"]
"""


def test_the_shipped_stacks_parse_and_have_a_default():
    shipped = stacks.load()
    assert "default" in shipped and shipped["default"].pins == ()
    seed = shipped["seed-001-gemma3-hybridcache"]
    assert "transformers==4.50.0" in seed.pins and "accelerate==1.5.2" in seed.pins


def test_a_stack_has_pins_selection_and_requirements():
    parsed = stacks.parse(GOOD)
    assert parsed["old"].pins == ("transformers==4.50.0", "accelerate>=1.5,<1.6")
    assert parsed["old"].select == ("--model", "gemma-cache")
    assert parsed["old"].requires == ("cuda",)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('"transformers==4.50.0"', '"transformers"'), "pins has 'transformers' without a version specifier"),
        (('"transformers==4.50.0"', '"transformers=4.50"'), "pins has 'transformers=4.50', not a requirement"),
        (('requires = ["cuda"]', 'requires = ["tpu"]'), "requires has unknown capability 'tpu'"),
        (('description = "an old stack"', ""), "stack 'old': missing field 'description'"),
        (("[stack.default]", "[stack.today]"), "stack 'default': missing"),
    ],
)
def test_a_malformed_stack_names_the_file_stack_and_field(change, message, tmp_path):
    path = tmp_path / "stacks.toml"
    path.write_text(GOOD.replace(*change))
    with pytest.raises(stacks.StackError) as info:
        stacks.load(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)
