"""The VAE split's verdict bookkeeping (``h3ms_async.vae.exactness``): kept per key, one warning per differing rank,
every verdict in the status document with the contract's fields; "unsplit" when no worker is left.  The probe itself
runs in tests/test_vae_split_comfy.py (a worker skewed on purpose is dropped) and tests/test_vae_split_cuda.py."""
from __future__ import annotations

import logging

import msgspec
import pytest
import torch

from h3ms_async.status import hub as status
from h3ms_async.status import records
from h3ms_async.vae import exactness

pytestmark = pytest.mark.fast


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> status.StatusHub:
    fresh = status.StatusHub()
    monkeypatch.setattr(status, "_hub", fresh)
    return fresh


def _keys(devices: list[str], shape: tuple[int, ...], weights: tuple) -> dict:
    return {(r, shape): exactness.verdict_key(r, devices, torch.float16, shape, weights, 1000 + r)
            for r in range(1, len(devices))}


@pytest.mark.parametrize("differing, left, verdict", [({2}, 1, "adjusted"), ({1, 2}, 0, "unsplit")])
def test_verdicts_are_kept_warned_once_and_recorded(hub, caplog, differing: set[int], left: int,
                                                    verdict: str) -> None:
    devices, shape, weights = ["cpu"] * 3, (1, 24, 7, 2, 3), ("test", verdict)
    keys = _keys(devices, shape, weights)
    assert all(exactness.known(k) is None for k in keys.values())
    outcomes = [exactness.Outcome(r, "cpu", shape, r not in differing, 12.5) for r in (1, 2)]
    with caplog.at_level(logging.WARNING):
        exactness.settle(outcomes + outcomes[1:], keys, devices, torch.float16, [1, 1, 1], left)
    assert [exactness.known(keys[(r, shape)]) for r in (1, 2)] == [r not in differing for r in (1, 2)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(differing) and all("decodes a 1x24x7x2x3 chunk differently from rank 0" in w
                                                   for w in warnings), warnings
    rows = hub.status()["exactness"]["verdicts"]
    assert [v["verdict"] for v in rows[:2]] == ["exact" if 1 not in differing else verdict, verdict]
    for row in rows:
        msgspec.convert(row, records.VerdictRecord)
        assert row["program"] == "vae" and row["op"] == "vae.chunk" and row["shards"] == [1, 1, 1]
        assert row["device"].startswith("cpu") and row["dtype"] == "float16" and row["probe_ms"] == 12.5


def test_a_key_names_rank_worker_devices_torch_dtype_shape_and_weights() -> None:
    key = exactness.verdict_key(1, ["cpu", "cpu"], torch.bfloat16, (1, 24, 7, 2, 3), ("vae.safetensors",), 4242)
    assert key[:2] == (1, 4242) and key[2].startswith("cpu") and key[4] == torch.__version__
    assert key[5:] == ("bfloat16", (1, 24, 7, 2, 3), ("vae.safetensors",))
    assert torch.equal(exactness.probe_latent((1, 2, 3), torch.float16), exactness.probe_latent((1, 2, 3),
                                                                                                torch.float16))


def test_a_rank_exact_on_its_second_probe_is_kept_with_the_reason(hub, caplog) -> None:
    devices, shape, weights = ["cpu"] * 2, (1, 24, 7, 2, 3), ("test", "retried")
    keys = _keys(devices, shape, weights)
    with caplog.at_level(logging.INFO):
        exactness.settle([exactness.Outcome(1, "cpu", shape, True, 20.0, retried=True)], keys, devices,
                         torch.float16, [1, 1], 1)
    assert exactness.known(keys[(1, shape)]) is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    row = hub.status()["exactness"]["verdicts"][0]
    assert row["verdict"] == "exact" and row["detail"].endswith("from its second decode on (the first differed)")
