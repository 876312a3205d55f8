"""A model kind whose first build in a process is slow, loaded with `-p cold_start` (tests only).

cold-start is tiny-transformer, except that the first model it creates in a process takes
COLD_START_S seconds (default 4) more, as a pretrained kind's first from_pretrained does when
its weights come from a cold disk. The harness's first use of a kind is its one-time work
(observing it, searching its learning rate, matrix/harness/kind_setup.py): that, not the first cell,
must pay for it.
"""

import os
import time

from matrix.models import register
from matrix.models.tiny_transformer import TinyTransformer

COLD_START_S = float(os.environ.get("COLD_START_S", "4"))
_created = []


class ColdStart(TinyTransformer):
    name = "cold-start"
    description = "tiny-transformer whose first model in a process takes seconds to create (test only)"

    def create(self):
        if not _created:
            time.sleep(COLD_START_S)
        _created.append(True)
        return super().create()


register(ColdStart())
