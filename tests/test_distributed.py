"""FSDP2 (`fully_shard`) over 2 CPU processes (gloo) trains a CPT model like DDP does, and exports (tests/test_cuda.py:
the same on one GPU rank, nccl)."""

import concurrent.futures
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist

from .fresh_python import run_python

STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, mode: str, out_dir: str, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world)
    wrapped = None
    try:
        from transformers import BertForSequenceClassification

        from hf_cpt import CPTConfig, find_precision_state, quantize_model, set_precision
        from hf_cpt.schedules.schedule import PrecisionSchedule
        from tests.helpers import tiny_bert_config

        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_bert_config())
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        model.to(device)
        quantize_model(model, CPTConfig(bits_min=3, bits_max=8, fused_error_quantizer=False))
        if mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in model.bert.encoder.layer:
                fully_shard(layer)
            wrapped = fully_shard(model)
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        schedule = PrecisionSchedule("cpt", 3, 8, STEPS, 2)
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own micro-batch
        losses, bits_seen = [], []
        for step in range(STEPS):
            set_precision(model, schedule(step), 8)
            bits_seen.append(find_precision_state(model).current[0])
            ids = torch.randint(5, 128, (4, 10), generator=generator).to(device)
            torch.manual_seed(1000 * step + rank)  # the error quantizer's noise, the same in both modes
            loss = wrapped(input_ids=ids, labels=ids[:, 0] % 3).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        if mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            full = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"losses": losses, "bits": bits_seen, "state": full}, os.path.join(out_dir, f"{mode}.pt"))
        gathered = [None] * world
        dist.all_gather_object(gathered, bits_seen)
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, f"{mode}-bits.pt"))
    finally:
        # torch 2.14 aborts the process at exit ("terminate called without an active exception") when a
        # DDP reducer outlives its process group: release the wrapper first.
        del wrapped
        gc.collect()
        dist.destroy_process_group()


def _launch(world: int, mode: str, out_dir: str, device: str = "cpu", env: dict | None = None) -> None:
    """``world`` processes of `_worker`, as a launcher starts them (processes of the tests' server,
    tests/fresh_python.py: the imports paid once, not once a rank)."""
    port = _free_port()
    commands = [["-c", f"from tests.test_distributed import _worker; _worker({rank}, {world}, {port}, {mode!r}, "
                       f"{out_dir!r}, {device!r})"] for rank in range(world)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=world) as pool:
        runs = list(pool.map(lambda command: run_python(command, cwd=ROOT, timeout=300, env=env), commands))
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"{mode} rank {rank}:\n{run.stderr[-3000:]}"


@pytest.mark.slow
def test_fsdp2_matches_ddp_and_exports(tmp_path):
    fsdp2_matches_ddp(tmp_path, world=2)
    _exports(tmp_path)


def fsdp2_matches_ddp(tmp_path, world: int, device: str = "cpu", env: dict | None = None) -> None:
    """The same steps under DDP and under FSDP2 on ``world`` ranks: the same bits on every rank, losses and trained
    weights."""
    for mode in ("ddp", "fsdp"):
        _launch(world, mode, str(tmp_path), device, env)
    ddp, fsdp = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "fsdp.pt")
    bits = torch.load(tmp_path / "fsdp-bits.pt")
    assert all(rank == ddp["bits"] for rank in bits) and len(set(bits[0])) > 1  # identical bits on every rank
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-4, abs=1e-5)
    for key, value in ddp["state"].items():
        torch.testing.assert_close(fsdp["state"][key], value, rtol=1e-4, atol=1e-5)


def _exports(tmp_path) -> None:
    fsdp = torch.load(tmp_path / "fsdp.pt")

    # the gathered full state dict exports a quantized checkpoint that loads back exactly
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    from hf_cpt import CPTConfig, quantize_model, save_quantized, set_eval_precision

    from .helpers import tiny_bert_config

    model = BertForSequenceClassification(tiny_bert_config())
    quantize_model(model, CPTConfig(bits_min=3, bits_max=8))
    model.load_state_dict(fsdp["state"])
    model.eval()
    set_eval_precision(model, 8)
    ids = torch.randint(5, 128, (3, 10))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    save_quantized(model, tmp_path / "export", bits=8, model_card=False)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
