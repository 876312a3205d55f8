"""Explorations (run with --explore): for each selected target cell, hypothesis searches the
variants the grid does not cover (matrix/strategies.py) for one that passes in fp32 but not
in the target's precision, and shrinks it (matrix/explore.py).

    pytest cases/test_explore.py --explore --model tiny-transformer --mode eval --engine torch

A target fails when it finds a failure the catalogue does not explain (a new finding); known
findings are recorded in the report and pass.
"""

import json

import pytest

from conftest import EXPLORATION_PROPERTY, catalogue_key, cuda_index, explore_clock_key, installed_key
from matrix.explore import Budget, explore
from matrix.report import exploration_record


def test_explore(explore_target, tmp_path, request):
    config = request.config
    budget = Budget(
        examples=config.getoption("matrix_explore_examples"),
        seconds=config.stash[explore_clock_key].next_share(),
        seed=config.getoption("matrix_explore_seed"),
        findings=config.getoption("matrix_explore_findings"),
    )
    catalogue = config.stash[catalogue_key]
    exploration = explore(
        explore_target,
        budget,
        tmp_path,
        catalogue,
        config.stash[installed_key],
        cuda_index=cuda_index(config),
    )
    request.node.user_properties.append((EXPLORATION_PROPERTY, exploration_record(exploration, catalogue)))
    new = [f for f in exploration.findings if f.status == "new"]
    if new:
        pytest.fail(
            "\n\n".join(
                f"{f.result.signature.id} {f.result.signature.text}\n"
                f"minimal variant, changed from the base: {json.dumps(f.differs_from_base)}\n"
                f"replay: {f.replay}\n\n{f.result.message}"
                for f in new
            ),
            pytrace=False,
        )
