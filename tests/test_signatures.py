"""Signature normalization: stable under run-to-run noise, distinct for distinct failures."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from matrix.results.signatures import Signature, normalize_message, origin_of, signature_of

# Real messages from the seeds and from this matrix's runs.
UPSTREAM_MESSAGES = [
    "expected mat1 and mat2 to have the same dtype, but got: c10::Half != float",
    "mat1 and mat2 must have the same dtype, but got BFloat16 and Float",
    "Attempting to unscale FP16 gradients.",
    "'HybridCache' object has no attribute 'float'",
    "expected scalar type Float but found BFloat16",
    "expected scalar type Float but found Half",
    "Expected BFloat16, got Float",
]

addresses = st.integers(min_value=0x1000, max_value=2**48).map(hex)
shapes = st.lists(st.integers(min_value=1, max_value=4096), min_size=1, max_size=4)
path_parts = st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), min_size=2, max_size=5)
line_numbers = st.integers(min_value=1, max_value=99999)
small_shapes = st.lists(st.integers(min_value=1, max_value=16), min_size=1, max_size=3)  # real tensors


@given(addresses, shapes, path_parts, line_numbers)
def test_noise_is_normalized_away(address, shape, parts, line):
    template = "Tensor at {addr} with shape torch.Size({shape}) failed in {path} line {line}: mat1 and mat2 ({mm})"
    message = template.format(
        addr=address,
        shape=list(shape),
        path="/" + "/".join(parts) + ".py",
        line=line,
        mm="x".join(map(str, [*shape, 3])),
    )
    reference = template.format(addr="0xdeadbeef", shape=[2, 8], path="/a/b.py", line=1, mm="2x3")
    assert normalize_message(message) == normalize_message(reference)


@given(small_shapes, small_shapes)
def test_same_bug_with_other_sizes_gives_same_signature(shape_a, shape_b):
    def failure(shape):
        try:
            torch.ones(*shape, 3) @ torch.ones(5, 2)
        except RuntimeError as exc:
            return signature_of("train_steps", exc)
        raise AssertionError("matmul of mismatched shapes did not raise")

    assert failure(shape_a).id == failure(shape_b).id


@pytest.mark.parametrize("message", UPSTREAM_MESSAGES)
def test_dtype_names_survive_normalization(message):
    names = re.findall(r"BFloat16|Float|c10::Half|Half|FP16|float", message)
    normalized = normalize_message(message)
    for name in names:
        assert name in normalized


@given(st.permutations(["torch.float32", "torch.float16", "torch.bfloat16"]))
def test_a_set_in_a_message_gives_one_signature_whatever_its_order(dtypes):
    """FSDP2 names the dtypes it met as a Python set, printed in the order of the dtypes' hashes, which
    differs between processes: hf:gpt_oss's fp16-loaded fsdp2 cell gave two signature ids under two
    order seeds of one run. A set's elements are sorted; a dict or a quoted brace is left as it is."""
    message = "FSDP expects uniform original parameter dtype but got {" + ", ".join(dtypes) + "}"
    assert normalize_message(message).endswith("but got {torch.bfloat16, torch.float16, torch.float32}")
    assert normalize_message("expected {'b': 1, 'a': 2}") == "expected {'b': <n>, 'a': <n>}"


def test_distinct_messages_give_distinct_ids():
    ids = {Signature("evaluate", "RuntimeError", normalize_message(m), "torch.x:f").id for m in UPSTREAM_MESSAGES}
    assert len(ids) == len(UPSTREAM_MESSAGES)


@given(st.sampled_from(UPSTREAM_MESSAGES), st.sampled_from(UPSTREAM_MESSAGES))
def test_ids_are_equal_exactly_when_texts_are(a, b):
    sig_a = Signature("train_steps", "RuntimeError", normalize_message(a), "torch.nn.functional:linear")
    sig_b = Signature("train_steps", "RuntimeError", normalize_message(b), "torch.nn.functional:linear")
    assert (sig_a.id == sig_b.id) == (a == b)


@pytest.mark.parametrize("field", ["phase", "exc_type", "message", "origin"])
def test_every_field_changes_the_id(field):
    base = Signature(
        "evaluate", "RuntimeError", "expected scalar type Float but found Half", "torch.nn.modules.transformer:forward"
    )
    changed = Signature(**{**base.__dict__, field: getattr(base, field) + "X"})
    assert changed.id != base.id
    assert re.fullmatch(r"sig-[0-9a-f]{8}", base.id)


def test_id_is_a_pure_function_of_the_text():
    """The same bug on two machines gives the same id: nothing but the text goes in."""
    sig = Signature(
        "evaluate",
        "RuntimeError",
        "expected scalar type Float but found BFloat16",
        "torch.nn.modules.transformer:forward",
    )
    expected = "evaluate: RuntimeError: expected scalar type Float but found BFloat16"
    assert sig.text == expected + " @ torch.nn.modules.transformer:forward"
    assert sig.id == "sig-ae7859b7"


def test_origin_is_the_innermost_frame_in_the_stack_under_test():
    with pytest.raises(RuntimeError) as info:
        torch.nn.Linear(3, 4)(torch.ones(2, 3, dtype=torch.bfloat16))
    assert origin_of(info.value) == "torch.nn.modules.linear:forward"


def test_origin_falls_back_to_the_innermost_frame():
    def failing_check():
        raise AssertionError("loss is nan")

    with pytest.raises(AssertionError) as info:
        failing_check()
    assert origin_of(info.value).endswith(":failing_check")


def test_origin_prefers_stack_frames_over_ours():
    from torch.nn import TransformerEncoder, TransformerEncoderLayer

    encoder = TransformerEncoder(TransformerEncoderLayer(8, 2, 16, batch_first=True), 1).eval()
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2:] = True
    with pytest.raises(RuntimeError) as info, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        encoder(torch.randn(2, 4, 8), src_key_padding_mask=mask)
    assert origin_of(info.value) == "torch.nn.modules.transformer:forward"


def test_a_matrix_check_called_by_a_library_keeps_the_check_as_origin():
    """A Trainer or Lightning callback runs our check: the origin stays the check, so the
    same check failing gives the same signature under every engine."""
    from matrix.checks import assertions as checks

    layer = torch.nn.Linear(2, 2)
    layer.register_forward_pre_hook(lambda module, args: checks.check_finite_loss(torch.tensor(float("nan")), "x"))
    with pytest.raises(checks.NonFiniteValue) as info:
        layer(torch.ones(1, 2))  # torch.nn.modules.module calls the hook
    assert origin_of(info.value) == "matrix.checks:check_finite_loss"


def test_a_failure_carrying_other_tracebacks_is_signed_by_its_own_line_and_the_innermost_error():
    """DCP's CheckpointException holds every rank's traceback in its message: the signature keeps its
    first line and the error the tracebacks end in, not the frames (paths and line numbers that
    change with every release)."""
    from matrix.results.signatures import message_of, signature_of

    gathered = (
        "CheckpointException ranks:dict_keys([0, 1])\n"
        "Traceback (most recent call last): (RANK 0)\n"
        '  File "/site-packages/torch/distributed/checkpoint/utils.py", line 193, in reduce_scatter\n'
        "    local_data = map_fun()\n"
        "RuntimeError: Missing key in checkpoint state_dict: optimizer.state.unused.weight.step.\n"
    )

    class Gathered(BaseException):
        pass

    assert message_of(Gathered(gathered)) == (
        "CheckpointException ranks:dict_keys([0, 1]): "
        "RuntimeError: Missing key in checkpoint state_dict: optimizer.state.unused.weight.step."
    )
    signed = signature_of("checkpoint_reload", Gathered(gathered))
    assert "Missing key in checkpoint state_dict" in signed.message and "File" not in signed.message
    assert message_of(ValueError("one line\nand a second")) == "one line\nand a second"  # no traceback: as it is


def test_what_a_cell_records_and_what_passes_through_its_except_clauses():
    """A library's BaseException is the cell's failure (DCP's CheckpointException); the interpreter's
    exits and pytest's outcomes (pytest-timeout stops a cell by raising Failed in it) pass through."""
    from _pytest.outcomes import Failed, Skipped

    from matrix.results.signatures import is_failure

    class LibraryAbort(BaseException):
        pass

    assert is_failure(LibraryAbort("the library gave up")) and is_failure(ValueError("x"))
    for passing in (Failed("Timeout"), Skipped("x"), KeyboardInterrupt(), SystemExit(1)):
        assert not is_failure(passing), passing
