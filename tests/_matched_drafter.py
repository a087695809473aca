"""Shared by tests/cpu/test_serve_dspark.py, tests/gpu/test_serve_spec_gpu.py and
tests/_spec_graph_case.py (the tensors only, `matched_tensors`): a real DSpark
checkpoint folder (tiny layout, Markov rank = vocab) whose drafts follow a given token
sequence: the backbone's output zeroed (final_norm = 0) and the Markov head the bigram table of
the sequence, so drafts are mostly accepted where a prompt continues that sequence and mostly
rejected elsewhere."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from raydecode.models.dspark import load_dspark_config, parse_dspark_config
from raydecode.models.dspark_checkpoint import write_dspark_checkpoint


def matched_tensors(dcfg, ids: list[int]) -> dict[str, torch.Tensor]:
    """The drafter tensors that make its drafts follow `ids` (dcfg's Markov rank = its vocab):
    the backbone's output zeroed, the Markov head the bigram table of `ids`."""
    V = dcfg.vocab_size
    w2 = torch.zeros(V, V)
    for prev, nxt in zip(ids, ids[1:]):
        w2[:, prev] = 0.0
        w2[nxt, prev] = 20.0
    return {"final_norm.weight": torch.zeros(dcfg.hidden_size),
            "markov_head.markov_w1.weight": torch.eye(V), "markov_head.markov_w2.weight": w2}


def matched_drafter(folder: Path, ids: list[int], name: str = "tiny-matched") -> Path:
    """Write the checkpoint into `folder` (write_dspark_checkpoint) and patch its tensors
    (`matched_tensors`); -> the folder."""
    raw = load_dspark_config("tiny").raw
    dcfg = parse_dspark_config(raw | {"markov_rank": raw["vocab_size"]}, name=name)
    path = write_dspark_checkpoint(dcfg, folder)
    new = matched_tensors(dcfg, ids)
    for f in path.glob("*.safetensors"):
        ts = load_file(str(f))
        if set(ts) & set(new):
            ts.update({n: t.to(ts[n].dtype) for n, t in new.items() if n in ts})
            save_file(ts, str(f), metadata={"format": "pt"})
    return path
