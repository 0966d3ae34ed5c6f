"""Context parallelism trains like one process, at a sequence length of 1024 (fp32, gloo).

The attention itself is checked first in fp64 against one-process SDPA (outputs and the gradients
of q, k and v, with and without document masks); then the real CLI runs cp=2 and cp=4 for both
families and cp=2 composed with dp=2 and with tp=2, against the single-process run of the same
model, data and seed: per-step losses within 1e-4 relative and final weights within 1e-4. The
dp=2 x cp=2 run and its reference also mask documents (data.doc_mask=true), so the trainer's
document path is covered end to end with cp.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    assert_equivalent,
    assert_layout,
    free_port,
    run_suite,
    train_losses,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS = 4
SEQ = 1024
MODEL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.vocab_size=512",
    f"model.max_seq_len={SEQ}",
    f"data.seq_len={SEQ}",
    "train.precision=fp32",
    "log.wandb=false",
    "log.progress=false",
]
COMMON = [
    "train.log_every=1",
    f"train.save_every={STEPS}",
    f"train.eval_every={STEPS}",
    "train.eval_batches=2",  # 2 held-out rows: one per data rank at dp=2 (the same rows in every layout)
    f"train.max_steps={STEPS}",
    "parallel.global_batch_size=2",  # 2 rows of 1024 tokens; the tiny corpus holds 42 of them
    "parallel.micro_batch_size=1",
    "optim.lr=3e-3",  # large steps from the first one, so a wrong gradient shows in the next loss
    "sched.warmup_steps=1",
    "train.save_grads_step=1",
]
LLAMA = ["recipe=llama-tiny", "model.num_kv_heads=2", "model.ffn_hidden_size=128"]

# name -> (processes, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "gpt-single": (1, []),
    "gpt-cp2": (2, ["parallel.cp=2"]),
    "gpt-cp4": (4, ["parallel.cp=4"]),
    "gpt-doc-single": (1, ["data.doc_mask=true"]),
    "gpt-doc-dp2-cp2": (4, ["data.doc_mask=true", "parallel.dp=2", "parallel.cp=2"]),
    "gpt-tp2-cp2": (4, ["parallel.tp=2", "parallel.cp=2"]),
    "llama-single": (1, LLAMA),
    "llama-cp2": (2, [*LLAMA, "parallel.cp=2"]),
    "llama-cp4": (4, [*LLAMA, "parallel.cp=4"]),
}


@pytest.fixture(scope="module")
def cp_run(tiny_data, tmp_path_factory):
    """cp_run(name) -> run dir of that layout (trained once, on first request)."""
    root = tmp_path_factory.mktemp("cp")
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            nproc, overrides = LAYOUTS[name]
            run_dir = root / name
            run_suite(
                "pretrain",
                *MODEL,
                f"data.path={tiny_data}",
                f"run.dir={run_dir}",
                *COMMON,
                *overrides,
                f"launch.nproc_per_node={nproc}",
                timeout=420,
                check=True,
            )
            done[name] = run_dir
        return done[name]

    return get


def reference(name: str) -> str:
    return "gpt-doc-single" if name.startswith("gpt-doc") else name.split("-")[0] + "-single"


def check_layout(cp_run, name: str) -> None:
    ref_dir, run_dir = cp_run(reference(name)), cp_run(name)
    ref_losses = train_losses(ref_dir)
    assert len(ref_losses) == STEPS
    assert ref_losses[STEPS] < ref_losses[1] - 0.3  # it learns: the comparison is not of constants
    assert_layout(run_dir, *LAYOUTS[name])
    assert_equivalent(ref_dir, run_dir)


@pytest.mark.parametrize("name", ["gpt-cp2", "llama-cp2"])
def test_cp2_matches_single_process(cp_run, name):
    check_layout(cp_run, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-cp4", "llama-cp4", "gpt-doc-dp2-cp2", "gpt-tp2-cp2"])
def test_four_process_cp_layout_matches_single_process(cp_run, name):
    check_layout(cp_run, name)


@pytest.mark.slow
def test_document_masking_changes_what_the_model_sees(cp_run):
    """The masked reference is not the plain run: rows of 1024 tokens hold ~9 documents each."""
    plain, masked = train_losses(cp_run("gpt-single")), train_losses(cp_run("gpt-doc-single"))
    assert all(abs(plain[s] - masked[s]) > 1e-4 for s in plain), (plain, masked)


# ---- the attention alone, in fp64 -----------------------------------------------------------------
def _attention_worker(rank: int, cp: int, port: int) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from suite.data.batch import Batch
    from suite.data.documents import document_ids
    from suite.models.document_attention import Documents, document_mask
    from suite.parallel.context_parallel import ContextParallelAttention, chunk_index, split_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        attention = ContextParallelAttention(True, dist.group.WORLD, cp, rank)
        gen = torch.Generator().manual_seed(0)
        b, heads, kv_heads, seq, dim = 2, 4, 2, 48, 8
        q, k, v = (
            torch.randn(b, h, seq, dim, generator=gen, dtype=torch.float64, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)
        )
        grad = torch.randn(b, heads, seq, dim, generator=gen, dtype=torch.float64)
        tokens = torch.randint(0, 6, (b, seq), generator=gen)  # id 0 ends a document: ~8 per row
        index = chunk_index(seq, cp, rank)
        for docs in (None, "varlen", "dense"):  # model.document_attention
            ids = document_ids(tokens, 0) if docs else None
            full_mask = document_mask(ids) if docs else None
            kwargs = split_batch(Batch(tokens, tokens, doc_ids=ids), cp, rank)[2]
            local_mask = Documents(kwargs["doc_ids"], dense=docs == "dense") if docs else None
            for t in (q, k, v):
                t.grad = None
            ref = F.scaled_dot_product_attention(
                q, k, v, attn_mask=full_mask, is_causal=not docs, enable_gqa=True
            )
            ref.backward(grad)
            mine = [t.detach()[:, :, index].clone().requires_grad_() for t in (q, k, v)]
            out = attention(*mine, local_mask)
            out.backward(grad[:, :, index])
            pairs = [(out, ref)] + [(m.grad, t.grad) for m, t in zip(mine, (q, k, v))]
            for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs):
                err = float((got - want[:, :, index]).abs().max())
                assert err < 1e-12, (f"cp={cp} rank {rank} docs={docs}: {what} differs by {err}",)
    finally:
        dist.destroy_process_group()


def test_attention_and_its_gradients_are_exact_across_ranks():
    torch.multiprocessing.spawn(_attention_worker, args=(2, free_port()), nprocs=2)
