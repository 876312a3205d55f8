"""A training stack whose checkpoint loading silently drops the optimizer's state, the class of
accelerate#3971 (accelerate 1.12's FSDP2 load_state gave back a fresh AdamW and raised nothing):
every torch optimizer's load_state_dict loads nothing, in each process that imports this plugin
(the run's process and its ranks). Its kinds are the user's GPT-2 of tests/plugins/user_gpt2.py and
the matrix's tiny-llama under other names, so that the ranks import this module too (the Trainer
trains the GPT-2 into a known loss-count failure first: tiny-llama reaches its resume). Loaded with
`-p forgetful_optimizer`; the resume check (matrix/harness/resume.py) must fail every engine's training cell.
"""

import copy

import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from user_gpt2 import UserGPT2

from matrix.models import register
from matrix.models.tiny_llama import TinyLlama


def _load_nothing(self, state_dict):  # what a library that loses the state does: no error, no state
    return None


torch.optim.Optimizer.load_state_dict = _load_nothing

# torch.distributed.checkpoint loads in place, into the tensors get_state_dict hands out, which are
# the optimizer's own: the state it gives is made a copy, so the load reaches it only through
# load_state_dict, as above.
_get_state_dict = dcp_state_dict.get_state_dict
_get_optimizer_state_dict = dcp_state_dict.get_optimizer_state_dict


def _get_state_dict_copied(*args, **kwargs):
    model_state, optimizer_state = _get_state_dict(*args, **kwargs)
    return model_state, copy.deepcopy(optimizer_state)


def _get_optimizer_state_dict_copied(*args, **kwargs):
    return copy.deepcopy(_get_optimizer_state_dict(*args, **kwargs))


dcp_state_dict.get_state_dict = _get_state_dict_copied
dcp_state_dict.get_optimizer_state_dict = _get_optimizer_state_dict_copied


class ForgetfulGPT2(UserGPT2):
    name = "forgetful-gpt2"
    description = "the user's GPT-2, in processes whose optimizers load no state from a checkpoint"


register(ForgetfulGPT2())


class ForgetfulLlama(TinyLlama):
    name = "forgetful-llama"
    description = "tiny-llama, in processes whose optimizers load no state from a checkpoint"


register(ForgetfulLlama())
