"""Embedding tables whose gradient adds to another's as rows (hf_cpt/nn/embedding_rows.py,
`CPTConfig.embedding_row_gradients`)."""

import copy

import pytest
import torch
from torch import nn

from hf_cpt import CPTConfig, CPTTrainer, dequantize_model, quantize_model, set_precision
from hf_cpt.nn import embedding_rows
from hf_cpt.nn.embedding_rows import EmbeddingAddingRows, convert_embedding, rows_gradient
from hf_cpt.utils import ConfigError

from .helpers import tiny_gpt2_config


@pytest.fixture
def rows_calls(monkeypatch):
    """How many lookups have handed their gradient over as rows (calls of `rows_gradient`)."""
    calls = []

    def counting(*args):
        calls.append(args[2])  # the table's size
        return rows_gradient(*args)

    monkeypatch.setattr(embedding_rows, "rows_gradient", counting)
    return calls


def tiny_gpt2_pair(layers: int = 2, **options):
    """A tiny GPT-2 (tied head) quantized with embedding row gradients, and the same model with dense ones."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(tiny_gpt2_config(layers))
    rows, dense = copy.deepcopy(base), copy.deepcopy(base)
    report = quantize_model(rows, CPTConfig(**options))
    quantize_model(dense, CPTConfig(embedding_row_gradients=False, **options))
    for model in (rows, dense):
        set_precision(model, 8, 8)
        model.train()
    return rows, dense, report


def backward_both(models, ids, seed):
    for model in models:
        torch.manual_seed(seed)  # the same dropout on both sides
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_tied_table_and_accumulated_micro_batches_get_the_same_gradients_bit_for_bit(rows_calls):
    """GPT-2's token table is tied to its head: from the first micro-batch on its gradient comes as rows; the position
    table, untied, as rows from the second micro-batch on (added to the first's ``.grad``). Every gradient equals the
    dense one's bit for bit, and ``.grad`` stays dense."""
    rows, dense, report = tiny_gpt2_pair()
    assert report.embedding_rows == ["transformer.wte", "transformer.wpe"]
    assert "embeddings whose gradient adds to another's as rows" in str(report)
    assert isinstance(rows.transformer.wte, EmbeddingAddingRows) and type(dense.transformer.wte) is nn.Embedding
    ids = torch.randint(0, 40, (4, 24))  # repeated ids: rows summed over several tokens
    expected_calls = [[128], [64, 128], [64, 128]]  # the table sizes whose gradient came as rows, per micro-batch
    for micro_batch, expected in enumerate(expected_calls):
        rows_calls.clear()
        backward_both((rows, dense), ids, micro_batch)
        assert sorted(rows_calls) == expected
        for (name, a), b in zip(rows.named_parameters(), dense.parameters()):
            assert a.grad.layout == torch.strided, name
            assert torch.equal(a.grad, b.grad), name


class TiedLanguageModel(nn.Module):
    """A table and an output layer that shares it, outside transformers."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = nn.Embedding(50, 16, dtype=dtype)
        self.head = nn.Linear(16, 50, bias=False, dtype=dtype)
        self.head.weight = self.table.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.table(ids))).float().logsumexp(-1).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_table_shared_by_a_plain_module_gets_its_rows_added_in_each_dtype(rows_calls, dtype):
    """`convert_embedding` finds the module that shares the table by its weight; in each float dtype the gradient
    is the dense one's bit for bit."""
    torch.manual_seed(0)
    plain = TiedLanguageModel(dtype)
    converted = copy.deepcopy(plain)
    assert convert_embedding(converted.table, converted)
    ids = torch.randint(0, 12, (6, 9))
    for model in (plain, converted):
        model(ids).backward()
    assert rows_calls == [50]
    grad = converted.table.weight.grad
    assert grad.dtype == dtype and torch.equal(grad, plain.table.weight.grad)


def test_a_padding_row_gets_no_gradient_as_with_the_dense_backward(rows_calls):
    """A padding id's row takes no gradient: as aten's dense backward, with the padding id among the looked-up ones
    and absent from them."""
    torch.manual_seed(0)
    plain = nn.Embedding(30, 8, padding_idx=3)
    converted = copy.deepcopy(plain)
    assert convert_embedding(converted, converted)
    for ids in (torch.tensor([[3, 5, 5, 7], [3, 3, 9, 5]]), torch.tensor([[1, 2, 2, 4]])):
        for table in (plain, converted):
            upstream = torch.arange(ids.numel() * 8, dtype=torch.float32).reshape(*ids.shape, 8).sin()
            (table(ids) * upstream).sum().backward()
    assert len(rows_calls) == 1  # the second lookup adds to the first's .grad
    assert torch.equal(converted.weight.grad, plain.weight.grad)
    assert torch.count_nonzero(converted.weight.grad[3]) == 0


def test_an_untied_tables_only_gradient_stays_dense(rows_calls):
    """With nothing to add its rows to (one micro-batch, no tied head), the table's gradient is aten's dense one:
    a sparse ``.grad`` would be refused by the optimizers."""
    torch.manual_seed(0)
    table = nn.Embedding(20, 4)
    convert_embedding(table, table)
    table(torch.tensor([1, 2, 2])).sum().backward()
    assert rows_calls == [] and table.weight.grad.layout == torch.strided
    torch.optim.AdamW(table.parameters()).step()


def test_double_backward_and_eval_keep_the_dense_path(rows_calls):
    """``create_graph=True`` (the gradient must be differentiable) and lookups outside training run as before."""
    torch.manual_seed(0)
    table = nn.Embedding(20, 4)
    convert_embedding(table, table)
    table(torch.tensor([1, 2])).sum().backward()
    (grad,) = torch.autograd.grad((table(torch.tensor([2, 3])) ** 2).sum(), table.weight, create_graph=True)
    assert rows_calls == [] and grad.requires_grad and grad.layout == torch.strided
    table.eval()
    table(torch.tensor([1, 2])).sum().backward()
    assert rows_calls == []


def test_a_head_run_after_an_eval_lookup_marks_no_training_pass(rows_calls):
    """A training forward that never reaches the head, then a forward in eval mode with gradients whose backward
    reaches the head: that head's gradient is not the training pass's, so the training lookup's gradient stays
    dense (a sparse one would become ``.grad``)."""
    torch.manual_seed(0)
    model = TiedLanguageModel(torch.float32)
    convert_embedding(model.table, model)
    ids = torch.tensor([[1, 2, 2, 5]])
    hidden = model.table(ids).sum()  # the training pass: the table alone
    model.eval()
    model(ids).backward()  # the head's gradient, in another graph
    model.train()
    model.zero_grad(set_to_none=True)
    hidden.backward()
    assert rows_calls == [] and model.table.weight.grad.layout == torch.strided


def test_a_copied_model_marks_its_own_tables(rows_calls):
    """`copy.deepcopy` of a converted model: the copy's head marks the copy's table (not the original's), whose
    gradient comes as rows, and the original is left alone."""
    rows, dense, _ = tiny_gpt2_pair()
    copied = copy.deepcopy(rows)
    assert copied.lm_head.__dict__["_cpt_tied_embeddings"] == [copied.transformer.wte]
    ids = torch.randint(0, 40, (2, 16))
    backward_both((copied, dense), ids, 0)
    assert rows_calls == [128] and rows.transformer.wte.__dict__.get("_cpt_pass") is None
    assert torch.equal(copied.transformer.wte.weight.grad, dense.transformer.wte.weight.grad)


def test_dequantize_restores_the_tables_and_removes_the_heads_hooks():
    rows, _, _ = tiny_gpt2_pair()
    assert len(rows.lm_head._forward_hooks) == 1
    dequantize_model(rows)
    assert type(rows.transformer.wte) is nn.Embedding and type(rows.transformer.wpe) is nn.Embedding
    assert len(rows.lm_head._forward_hooks) == 0 and "_cpt_tied_embeddings" not in rows.lm_head.__dict__


def test_a_table_tied_after_conversion_is_found_through_the_output_embeddings(rows_calls):
    """transformers may tie the head after `quantize_model` (loading a checkpoint): the model's output embeddings are
    hooked anyway, and whether they share the table is asked at each forward."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2_config())
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied at conversion
    quantize_model(model, CPTConfig())
    set_precision(model, 8, 8)
    model.train()
    ids = torch.randint(0, 40, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert rows_calls == []
    model.zero_grad(set_to_none=True)
    model.lm_head.weight = model.transformer.wte.weight  # tied now
    model(input_ids=ids, labels=ids).loss.backward()
    assert rows_calls == [128]


def test_cpt_trainer_with_gradient_accumulation_trains_the_same_either_way(tmp_path, rows_calls):
    """Under CPTTrainer (its default fused AdamW) with accumulated micro-batches, the trained weights are the same
    bit for bit with and without the row gradients."""
    from transformers import GPT2LMHeadModel, TrainingArguments

    ids = torch.randint(0, 100, (24, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trained = []
    for as_rows in (True, False):
        torch.manual_seed(0)
        trainer = CPTTrainer(
            model=GPT2LMHeadModel(tiny_gpt2_config()),
            args=TrainingArguments(output_dir=str(tmp_path / str(as_rows)), per_device_train_batch_size=4,
                                   gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3,
                                   save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0),
            train_dataset=data,
            cpt_config=CPTConfig(bits_min=4, bits_max=8, num_cycles=1, embedding_row_gradients=as_rows),
        )
        trainer.train()
        trained.append(trainer.model.state_dict())
        # 3 steps of 2 micro-batches: the token table's gradient as rows in each, the position table's in the second
        assert sorted(rows_calls) == ([64] * 3 + [128] * 6 if as_rows else [])
        rows_calls.clear()
    for name, value in trained[0].items():
        assert torch.equal(value, trained[1][name]), name


def test_embedding_row_gradients_must_be_a_bool():
    with pytest.raises(ConfigError, match="embedding_row_gradients"):
        CPTConfig(embedding_row_gradients="yes")


def _tied_worker(rank: int, world: int, port: int, mode: str, as_rows: bool, out_dir: str) -> None:
    """One rank of a tied GPT-2 trained with accumulated micro-batches under DDP (the first micro-batch in
    ``no_sync``) or FSDP2, with or without row gradients."""
    import contextlib
    import gc
    import os

    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    from tests.helpers import tiny_gpt2_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    wrapped, calls = None, []
    rows_of = embedding_rows.rows_gradient
    embedding_rows.rows_gradient = lambda *args: calls.append(args[2]) or rows_of(*args)
    try:
        torch.manual_seed(0)
        config = tiny_gpt2_config()
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        model = GPT2LMHeadModel(config)
        quantize_model(model, CPTConfig(embedding_row_gradients=as_rows, fused_error_quantizer=False))
        set_precision(model, 8, 8)
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            wrapped = fully_shard(model)
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(100 + rank)
        for step in range(2):
            for micro_batch in range(2):
                ids = torch.randint(0, 60, (2, 12), generator=generator)
                syncing = micro_batch == 1
                if mode == "fsdp":
                    wrapped.set_requires_gradient_sync(syncing)
                    context = contextlib.nullcontext()
                else:
                    context = contextlib.nullcontext() if syncing else wrapped.no_sync()
                torch.manual_seed(1000 * step + 10 * micro_batch + rank)  # the error quantizer's noise
                with context:
                    wrapped(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"state": state, "rows": sorted(calls)}, os.path.join(out_dir, f"{mode}-{as_rows}.pt"))
    finally:
        del wrapped
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_train_a_tied_model_the_same_with_row_gradients(tmp_path, mode):
    """Two gloo ranks, a tied GPT-2, two accumulated micro-batches a step: the rows are added before the gradients
    are reduced, and the trained weights are those of the dense gradients bit for bit."""
    import concurrent.futures
    import os

    from .fresh_python import run_python
    from .test_distributed import ROOT, _free_port

    for as_rows in (True, False):
        port = _free_port()
        commands = [["-c", f"from tests.test_embedding_rows import _tied_worker; _tied_worker({rank}, 2, {port}, "
                           f"{mode!r}, {as_rows}, {str(tmp_path)!r})"] for rank in range(2)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            runs = list(pool.map(lambda command: run_python(command, cwd=ROOT, timeout=300), commands))
        for rank, run in enumerate(runs):
            assert run.returncode == 0, f"rank {rank}:\n{run.stderr[-3000:]}"
    rows, dense = (torch.load(os.path.join(tmp_path, f"{mode}-{as_rows}.pt")) for as_rows in (True, False))
    # each step: the token table's gradient as rows in both micro-batches, the position table's in the second
    assert rows["rows"] == [64] * 2 + [128] * 4 and dense["rows"] == []
    rows, dense = rows["state"], dense["state"]
    for name, value in dense.items():
        assert torch.equal(rows[name], value), name
    assert not torch.equal(rows["transformer.wte.weight"], _initial_token_table())


def _initial_token_table() -> torch.Tensor:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(tiny_gpt2_config()).transformer.wte.weight.detach()


@pytest.mark.slow
def test_a_compiled_model_looks_up_as_it_was(rows_calls):
    """Under torch.compile the lookups and the head's hook step aside: the traced graph trains with dense table
    gradients."""
    rows, _, _ = tiny_gpt2_pair(layers=1)  # one block: dynamo's tracing takes seconds a block
    compiled = torch.compile(rows, backend="eager")  # dynamo traces the lookups and hooks; no kernel compiled
    ids = torch.randint(0, 40, (2, 16))
    for _ in range(2):
        compiled(input_ids=ids, labels=ids).loss.backward()
    grad = rows.transformer.wte.weight.grad
    assert rows_calls == [] and grad.layout == torch.strided and torch.count_nonzero(grad) > 0
