"""scripts/train_default_mtp.py: a few CPU steps on a tiny corpus write a model whose main tensors are the shipped
ones and whose MTP tensors are new, byte-identical run to run; and its accept-length replay drafts what a chained
draft computed one step at a time over a plain causal sequence drafts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeserve.models.default_heldout import shipped_windows
from moeserve.models.default_model import SHIPPED_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_default_mtp.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("train_default_mtp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_runs_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    import bisect
    import colorsys
    import glob

    for mod in (bisect, colorsys, glob):  # bisect.py and glob.py fall in the held-out part
        (corpus / Path(mod.__file__).name).write_text(Path(mod.__file__).read_text())

    def train(out: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--threads", "1", "--steps", "3", "--batch-size", "2",
               "--seq-len", "32", "--corpus-dir", str(corpus), "--eval-windows", "2", "--eval-every", "3",
               "--log-every", "1", "--chain-prompts", "2", "--chain-prompt-len", "16", "--chain-tokens", "6",
               "--out", str(out)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)

    out, again = tmp_path / "model", tmp_path / "again"
    for directory in (out, again):
        run = train(directory)
        assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((out / "training_mtp.json").read_text())
    assert record["steps_run"] == 3 and len(record["loss"]) == 3
    assert record["corpus"]["heldout_files"] == ["bisect.py", "glob.py"]
    assert sorted(record["greedy_chain"]["accept_length"]) == ["1", "2", "3"]
    assert all(1.0 <= v <= k + 1 for k, v in ((int(k), v) for k, v in record["greedy_chain"]["accept_length"].items()))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    shipped, written = load_file(str(SHIPPED_DIR / "model.safetensors")), load_file(str(out / "model.safetensors"))
    main = {k for k in written if not k.startswith("model.layers.4.")}
    assert main == {k for k in shipped if not k.startswith("model.layers.4.")}
    assert all(torch.equal(written[k], shipped[k]) for k in main)  # the main model is frozen
    assert set(written) - main == set(record["mtp_tensors"])
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


@torch.no_grad()
def test_chained_drafts_match_a_step_by_step_forward():
    pytest.importorskip("transformers")
    torch.set_num_threads(1)
    t = _script()
    device = torch.device("cpu")
    main = t.load_main(SHIPPED_DIR, device)
    torch.manual_seed(3)
    mtp = t.build_mtp(main, seed=3).eval()
    for p in mtp.parameters():  # off its initialization, so that every tensor matters
        p.add_(torch.randn_like(p) * 0.01)
    seq = torch.tensor(shipped_windows()[1:3])[:, :24]
    depth = 3
    drafts = t.chained_drafts(main, mtp, seq, depth, device)  # [B, depth, L-1]
    hidden, _ = t.teacher(main, seq, device)
    for start in (0, 7, 19):
        # the module's cache: step 1 at starts 0..start, then steps 2.. appended one position at a time
        n = start + 1
        tokens, hiddens, positions, prev = [seq[:, 1:n + 1]], [hidden[:, :n]], [torch.arange(n)], None
        for j in range(depth):
            if start + j + 1 >= seq.shape[1]:
                break
            if j:
                tokens.append(seq[:, start + j + 1:start + j + 2])
                hiddens.append(prev)
                positions.append(torch.tensor([start + j]))
            ids, h, pos = torch.cat(tokens, 1), torch.cat(hiddens, 1), torch.cat(positions)
            embeds = main.model.embed_tokens(ids)
            mask = t.additive_mask(torch.ones(len(pos), len(pos), dtype=torch.bool).tril())
            prev = mtp.draft(embeds, h, t.rope(main, embeds, pos), mask)[:, -1:]
            assert torch.equal(main.lm_head(prev).argmax(-1)[:, 0], drafts[:, j, start]), (start, j)
