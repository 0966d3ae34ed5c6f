#!/usr/bin/env python
"""Could DCP's HuggingFaceStorageReader/Writer replace suite's lazy HF readers? Measured, not guessed.

    python bench/hf_dcp_io.py            # both parts, CPU, ~1 minute; the numbers docs/architecture.md cites

import  (2 gloo processes, FSDP2 shards dim 0 of every parameter): tiny GPT-2, Llama and Llama
        loaded with model.fused_projections=true, each from an HF folder, two ways: suite.model_source
        (lazy mapping, each rank reads its own box of every tensor) and DCP's HuggingFaceStorageReader
        behind the suite -> HF name table as torchtitan uses it (to_hf on the model's DTensors,
        dcp.load, from_hf, copy back). Per rank: bytes read from the safetensors files, bytes the load
        targets hold at once, and whether both give the same parameters bitwise.
export  (one process): an 87M-parameter llama DCP checkpoint to an HF folder of 64 MB shards: suite's
        streaming writer vs dcp.save with HuggingFaceStorageWriter (which needs the state dict it
        writes in memory); peak RSS above the interpreter's, and whether transformers loads both alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

SHARD_BYTES = 64 * 2**20


def _make_hf(kind: str, out: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    else:
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)


def _sharded_model(cfg, mesh):
    from torch.distributed.fsdp import fully_shard

    from suite.models import build_model, materialize

    model = materialize(build_model(cfg), "cpu", seed=0)
    fully_shard(model, mesh=mesh)
    return model


def _import_worker(rank: int, folder: str, fused: bool, port: int, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh

    import suite.model_source as sources
    from suite.models.hf_mapping import from_hf_state_dict, model_config_from_hf, to_hf_state_dict

    mesh = init_device_mesh("cpu", (2,))
    cfg = dataclasses.replace(model_config_from_hf(Path(folder)), fused_projections=fused)
    counts = {"ours_read": 0, "dcp_read": 0}
    # suite.model_source: count what the lazy readers take from the files
    original = sources.hf_weights

    def counting(*args, **kwargs):
        manager = original(*args, **kwargs)
        tensors = manager.__enter__()
        for value in tensors.values():
            read = value.reader

            def tally(box, read=read):
                out = read(box)
                counts["ours_read"] += out.numel() * out.element_size()
                return out

            value.reader = tally
        return _Entered(manager, tensors)

    sources.hf_weights = counting
    ours = _sharded_model(cfg, mesh)
    sources.ModelSource.parse(f"hf:{folder}").load_weights(ours, fused)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in ours.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())

    class CountingReader(HuggingFaceStorageReader):
        def _process_read_request(self, f, req, planner):
            counts["dcp_read"] += torch.Size(req.lengths).numel() * 4
            return super()._process_read_request(f, req, planner)

    theirs = _sharded_model(cfg, mesh)
    error, held = None, 0
    try:
        hf_sd = to_hf_state_dict(cfg, dict(theirs.state_dict()))
        if cfg.tie_embeddings:
            hf_sd.pop("lm_head.weight", None)
        own = {p.to_local().untyped_storage().data_ptr() for p in theirs.parameters()}
        local = [v.to_local() if hasattr(v, "to_local") else v for v in hf_sd.values()]
        held = sum(t.numel() * t.element_size() for t in local if t.untyped_storage().data_ptr() not in own)
        dcp.load(
            hf_sd, storage_reader=CountingReader(folder), planner=DefaultLoadPlanner(allow_partial_load=True)
        )
        back = from_hf_state_dict(cfg, hf_sd)
        with torch.no_grad():
            for name, param in theirs.named_parameters():
                value = back[name]
                if hasattr(value, "redistribute"):
                    value = value.redistribute(param.device_mesh, param.placements)
                param.to_local().copy_(value.to_local())
    except Exception as exc:  # noqa: BLE001 (the point is to report what fails)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    same = None
    if error is None:
        same = all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        )
    row = {
        **counts,
        "shard": shard_bytes,
        "full": full_bytes,
        "ours_extra_at_once": max(p.to_local().numel() * p.element_size() for p in ours.parameters()),
        "dcp_extra_at_once": held,
        "same": same,
        "error": error,
    }
    Path(f"{result}.{rank}").write_text(json.dumps(row))
    dist.destroy_process_group()


class _Entered:
    """A context manager already entered (the counting wrapper's)."""

    def __init__(self, manager, value):
        self.manager, self.value = manager, value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


def import_part(tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for i, (kind, fused) in enumerate((("gpt2", False), ("llama", False), ("llama", True))):
        folder = tmp / f"{kind}-hf"
        if not folder.exists():
            _make_hf(kind, folder)
        result = str(tmp / f"import-{i}")
        mp.spawn(_import_worker, args=(str(folder), fused, 29611 + i, result), nprocs=2, join=True)
        ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(2)]
        rows.append({"case": kind + (" fused" if fused else ""), **ranks[0]})
    return rows


# ---- export ------------------------------------------------------------------------------------------
EXPORT_CFG = dict(
    name="llama-90m",
    family="llama",
    num_layers=6,
    hidden_size=768,
    num_heads=12,
    num_kv_heads=4,
    ffn_hidden_size=2048,
    vocab_size=32000,
    max_seq_len=256,
    tie_embeddings=False,
)


def _export_child(how: str, ckpt: str, out: str) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from suite.config.schema import ModelConfig
    from suite.export.hf import write_hf_folder
    from suite.model_source import checkpoint_weights
    from suite.models.hf_mapping import hf_config, to_hf_state_dict

    cfg = ModelConfig(**EXPORT_CFG)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
    base = _status_kb("VmRSS")
    if how == "suite":
        write_hf_folder(cfg, checkpoint_weights(Path(ckpt)), Path(out), max_shard_bytes=SHARD_BYTES)
    elif how == "dcp-stream":  # the writer fed one output file at a time, as suite's writer works
        lazy = to_hf_state_dict(cfg, checkpoint_weights(Path(ckpt)))
        index = _groups(lazy)
        for group in sorted(set(index.values())):
            part = {n: v.read().contiguous() for n, v in lazy.items() if index[n] == group}
            dcp.save(
                part, storage_writer=HuggingFaceStorageWriter(out, fqn_to_index_mapping=index), no_dist=True
            )
            del part
        hf_config(cfg).save_pretrained(out)
    else:  # the writer given the state dict whole, as its API expects
        meta = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        sd = {
            k: torch.empty(v.size, dtype=v.properties.dtype)
            for k, v in meta.items()
            if k.startswith("model.")
        }
        dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
        hf = to_hf_state_dict(cfg, {k.removeprefix("model."): v for k, v in sd.items()})
        del sd
        dcp.save(
            hf, storage_writer=HuggingFaceStorageWriter(out, fqn_to_index_mapping=_groups(hf)), no_dist=True
        )
        hf_config(cfg).save_pretrained(out)
    peak = _status_kb("VmHWM")
    print(
        json.dumps({"how": how, "peak_above_start_mb": round((peak - base) / 1024), "start_mb": base // 1024})
    )


def _groups(hf: dict) -> dict[str, int]:
    """Output file (1..n) of every tensor: files of at most SHARD_BYTES, in order."""
    index, size, group = {}, 0, 1
    for name, value in hf.items():
        nbytes = value.numel() * value.dtype.itemsize
        if size and size + nbytes > SHARD_BYTES:
            group, size = group + 1, 0
        index[name], size = group, size + nbytes
    return index


def _status_kb(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def export_part(tmp: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from suite.config.schema import ModelConfig
    from suite.models import build_model, materialize

    ckpt = tmp / "ckpt"
    if not ckpt.exists():
        model = materialize(build_model(ModelConfig(**EXPORT_CFG)), "cpu", seed=0)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
        del model
    rows, ids = [], torch.arange(12).view(1, 12)
    reference = None
    for how in ("suite", "dcp", "dcp-stream"):
        out = tmp / f"export-{how}"
        proc = subprocess.run(
            [sys.executable, __file__, "--export-child", how, str(ckpt), str(out)],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["files"] = len(list(out.glob("*.safetensors")))
        row["names_in_index"] = len(
            json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        )
        try:
            logits = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
            reference = logits if reference is None else reference
            row["transformers_loads"] = (
                "same logits" if torch.equal(logits, reference) else "different logits"
            )
        except Exception as exc:  # noqa: BLE001 (reported)
            row["transformers_loads"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        rows.append(row)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--export-child"]:
        _export_child(*sys.argv[2:5])
        return
    with tempfile.TemporaryDirectory(prefix="hf-dcp-") as tmp:
        for row in import_part(Path(tmp)):
            print(json.dumps(row))
        for row in export_part(Path(tmp)):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
