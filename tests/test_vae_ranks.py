"""Where the VAE split takes its ranks: ``H3MS_VAE_RANK_MAP``, then ``H3MS_RANK_MAP`` (the DiT split's), then the
node's GPU Set; ``max_gpus`` (the node's, and a connected GPU Set's own) caps each of them."""
from __future__ import annotations

import pytest
import torch

from h3ms_async.runtime.plans import GPUSelectionError, GPUSet
from nodes.vae_split_node import plan_devices

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")


def _cfg(max_gpus: int = 4, gpus: GPUSet | None = None) -> dict:
    return {"gpus": gpus, "max_gpus": max_gpus, "second_gpu": -1}


@pytest.fixture(autouse=True)
def _no_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("H3MS_VAE_RANK_MAP", raising=False)
    monkeypatch.delenv("H3MS_RANK_MAP", raising=False)


def test_the_dit_rank_map_splits_the_vae_when_its_own_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan_devices(CPU, _cfg())[0] is None  # no map: a CPU VAE decodes unsplit
    monkeypatch.setenv("H3MS_RANK_MAP", "cpu,cpu,cpu")
    devices, why = plan_devices(CPU, _cfg())
    assert devices == ["cpu"] * 3 and why.startswith("H3MS_RANK_MAP=cpu,cpu,cpu"), why


def test_the_vae_rank_map_wins_over_the_dit_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H3MS_RANK_MAP", "cuda:1,cuda:1")  # would not even fit this VAE's device: never read
    monkeypatch.setenv("H3MS_VAE_RANK_MAP", "cpu,cpu")
    devices, why = plan_devices(CPU, _cfg())
    assert devices == ["cpu", "cpu"] and why.startswith("H3MS_VAE_RANK_MAP=cpu,cpu"), why


@pytest.mark.parametrize("max_gpus, gpu_set_max, want", [(2, None, 2), (8, 3, 3), (4, 2, 2), (1, None, 0)])
def test_max_gpus_caps_a_rank_map(monkeypatch: pytest.MonkeyPatch, max_gpus: int, gpu_set_max: int | None,
                                  want: int) -> None:
    monkeypatch.setenv("H3MS_RANK_MAP", ",".join(["cpu"] * 5))
    gpus = GPUSet(max_gpus=gpu_set_max) if gpu_set_max is not None else None
    devices, why = plan_devices(CPU, _cfg(max_gpus, gpus))
    assert (devices or []) == ["cpu"] * want, why
    assert f"at most {max(want, 1)} ranks: dropped" in why, why  # the log line says what the cap dropped


@pytest.mark.parametrize("var, fix", [("H3MS_VAE_RANK_MAP", "start the map with cpu"),
                                      ("H3MS_RANK_MAP", "set H3MS_VAE_RANK_MAP to the VAE's ranks")])
def test_a_map_whose_rank_0_is_not_the_vae_device_is_refused(monkeypatch: pytest.MonkeyPatch, var: str,
                                                             fix: str) -> None:
    monkeypatch.setenv(var, "cuda:0,cuda:1")
    with pytest.raises(GPUSelectionError, match=f"{var}=cuda:0,cuda:1: rank 0 is cuda:0 but the VAE decodes on "
                                                f"cpu; {fix}"):
        plan_devices(CPU, _cfg())
