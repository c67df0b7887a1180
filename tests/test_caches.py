"""The weight cache and the text-encoder output cache (h3ms_async/caches.py), on real tensors and modules."""
from __future__ import annotations

import gc
import weakref

import psutil
import pytest
import torch

from h3ms_async import caches
from h3ms_async.caches import CacheRefused, Freed, OutputCache, WeightCache, digest
from h3ms_async.status.hub import StatusHub, get_hub

pytestmark = pytest.mark.fast


def test_digest_covers_dtype_shape_bytes_order_and_keys() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    base = digest([[(t, 1.0)]], {"a": 1, "b": 2})
    assert base == digest([[(t.clone(), 1.0)]], {"b": 2, "a": 1})  # map order does not matter
    assert base != digest([[(t.double(), 1.0)]], {"a": 1, "b": 2})
    assert base != digest([[(t.reshape(3, 2), 1.0)]], {"a": 1, "b": 2})
    t2 = t.clone()
    t2[1, 2] = 5.000001
    assert base != digest([[(t2, 1.0)]], {"a": 1, "b": 2})
    assert base != digest([[(t, 1.0)]], {"a": 1, "b": 3})
    assert digest([1, 2]) != digest((1, 2)) and digest([1, 2]) != digest([2, 1])


def test_digest_of_token_lists_sees_every_token_weight_and_type() -> None:
    pairs = [[(int(i), 1.0) for i in range(300)]]
    base = digest({"l": pairs})
    # equal values built another way (fresh ints and floats, no shared objects) give the same key
    assert base == digest({"l": [[(int(str(i)), float("1.0")) for i in range(300)]]})
    changed = [[*pairs[0][:150], (150, 1.0000001), *pairs[0][151:]]]
    assert base != digest({"l": changed})
    assert base != digest({"l": [[*pairs[0][:299], (300, 1.0)]]})
    assert digest([(1, 1.0)]) != digest([(1, 1)]) and digest([(1, 1.0)]) != digest([(True, 1.0)])
    assert digest([(1, 0.0)]) != digest([(1, -0.0)]) and digest([[1]]) != digest([(1,)])
    # a token list carrying an embedding tensor walks item by item and still sees the tensor's bytes
    emb = torch.ones(4)
    with_emb = [[(emb, 1.0), (5, 1.0)]]
    assert digest(with_emb) == digest([[(emb.clone(), 1.0), (5, 1.0)]])
    assert digest(with_emb) != digest([[(emb * 2, 1.0), (5, 1.0)]])


def test_fetch_computes_once_and_hits_with_an_equal_copy() -> None:
    c = OutputCache()
    calls = []

    def compute() -> tuple:
        calls.append(1)
        return torch.randn(1, 5, 8), {"pooled_output": torch.randn(1, 8)}

    parts = (("te", "f", 1), None, [("clip_l", "last", None, False)], [[(1, 1.0), (2, 0.5)]])
    miss, key, hit = c.fetch(parts, compute, 4)
    again, key2, hit2 = c.fetch(parts, compute, 4)
    assert not hit and hit2 and key == key2 and len(calls) == 1
    assert torch.equal(again[0], miss[0]) and torch.equal(again[1]["pooled_output"], miss[1]["pooled_output"])
    assert again[0] is not miss[0]
    _, _, hit3 = c.fetch((*parts[:2], [("clip_l", "hidden", -2, False)], parts[3]), compute, 4)
    assert not hit3 and len(calls) == 2


def test_output_cache_hit_is_an_equal_copy_and_lru_bounded() -> None:
    c = OutputCache()
    out = (torch.randn(1, 7, 16), torch.randn(1, 16), {"pooled_output": torch.randn(1, 16), "n": 3})
    assert c.get("k1") is None
    assert c.put("k1", out, max_entries=2)
    hit = c.get("k1")
    assert all(torch.equal(a, b) for a, b in zip(hit[:2], out[:2])) and torch.equal(hit[2]["pooled_output"],
                                                                                     out[2]["pooled_output"])
    hit[0].zero_()  # a caller editing its result must not change the cache
    assert torch.equal(c.get("k1")[0], out[0])
    c.put("k2", out, max_entries=2)
    c.put("k3", out, max_entries=2)
    assert c.get("k1") is None and c.get("k2") is not None
    st = c.stats()
    assert st["entries"] == 2 and st["hits"] == 3 and st["misses"] == 2 and st["bytes"] == 2 * caches._nbytes(out)
    assert c.clear()[0] == 2 and c.stats()["entries"] == 0 and c.stats()["hits"] == 3
    assert not c.put("k4", out, max_entries=0)  # 0 entries: the cache is off
    assert c.stats()["entries"] == 0


def test_output_cache_honours_the_ram_reserve() -> None:
    c = OutputCache()
    c.put("a", torch.zeros(10), max_entries=8)
    assert not c.put("b", torch.zeros(10), max_entries=8, reserve_gb=1e6)  # no machine keeps 1 PB free
    assert c.stats()["entries"] == 0  # the reserve also evicted what was there


def _rss() -> int:
    """This process's RSS once the C heap's free pages and torch's cached pinned blocks are back with
    the OS, so that a drop measured from it is what the code in between gave back, not what an earlier
    free left behind."""
    gc.collect()
    caches._free_pinned_pool()
    caches._trim_heap()
    return psutil.Process().memory_info().rss


# how far a release's reported freed_bytes may be from the RSS drop it caused: page rounding and the
# interpreter's own allocations (the figures measured here are a few hundred MiB; a wrong one is off by
# tens to hundreds of MiB)
RSS_TOLERANCE = 8 << 20
PINNED = torch.cuda.is_available()  # the weight cache pins its buffers exactly when CUDA is available


def test_output_cache_clear_gives_the_bytes_back() -> None:
    c = OutputCache()
    big = torch.ones(64 << 20)  # 256 MiB
    before = _rss()
    assert c.put("k", (big, {"pooled_output": big[:8]}), max_entries=4)
    stored = weakref.ref(c.get("k")[0])  # a copy: dies at once
    held = c.stats()["bytes"]
    grown = _rss() - before
    assert held == big.nbytes + 32 and grown > 200 << 20, (held, grown)
    n, freed = c.clear()
    assert n == 1 and c.stats()["bytes"] == 0 and freed == Freed(held, 0, 0), freed
    assert stored() is None and _rss() - before < 64 << 20, _rss() - before


def test_output_cache_clear_reports_the_rss_it_gives_back() -> None:
    """Many small outputs (each below glibc's mmap threshold, so freed into its heap): the bytes the
    clear reports are the bytes the process's RSS drops."""
    c = OutputCache()
    for i in range(250):  # 250 x 1 MiB
        assert c.put(f"k{i}", (torch.full((1, 256, 1024), float(i)), {"pooled_output": torch.ones(1, 1024)}),
                     max_entries=250)
    held = c.stats()["bytes"]
    before = _rss()
    n, freed = c.clear()
    dropped = before - psutil.Process().memory_info().rss
    assert n == 250 and abs(dropped - freed.freed_bytes) <= RSS_TOLERANCE, (dropped, freed)
    assert freed == Freed(held, 0, 0), (freed, held)


def test_weight_cache_homes_host_weights_counts_a_load_and_releases_its_copy() -> None:
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128))
    want = {n: t.clone() for n, t in caches.named_tensors(mod).items()}
    wc = WeightCache()
    assert wc.home("te:a", ("te", "file-a", 1), mod) == "homed"
    [entry] = [wc.get("te:a", ("te", "file-a", 1))]
    # the module's host tensors are the cache's buffers: no second copy
    assert all(t.data_ptr() == entry.tensors[n].data_ptr() for n, t in caches.named_tensors(mod).items())
    assert wc.bytes_held() == entry.nbytes == sum(t.nbytes for t in want.values())
    assert not wc.note_loaded("te:a", mod)  # nothing moved yet
    for t in caches.named_tensors(mod).values():
        t.data = t.data.clone()  # what a load to another device leaves: the tensors no longer in the buffers
    assert wc.note_loaded("te:a", mod) and entry.restores == 1 and not wc.note_loaded("te:a", mod)
    assert wc.home("te:a", ("te", "file-a", 1), mod) == "homed" and wc.get("te:a", ("te", "file-a", 1)) is entry
    assert entry.homes == 2
    buffers = [weakref.ref(t) for t in entry.tensors.values()]
    [row] = wc.summaries()
    assert row["state"] == "held" and row["bytes"] == entry.nbytes and row["restores"] == 1
    # the module's host weights are the cache's buffers: releasing keeps them, with the module
    freed = wc.release("te:a")
    assert freed.kept_bytes == entry.nbytes and wc.bytes_held() == 0 and wc.summaries() == [], freed
    assert PINNED or freed == Freed(0, 0, entry.nbytes), freed
    del entry
    gc.collect()
    assert all(r() is None for r in buffers), "a released copy must not stay referenced"
    assert all(torch.equal(t, want[n]) for n, t in caches.named_tensors(mod).items())
    with pytest.raises(CacheRefused, match="cache_ram_reserve_gb"):
        wc.home("vae:x", ("vae", "x"), mod, reserve_gb=1e6)
    wc.stand_aside("te:b", "its load device and offload device are both cpu")
    assert wc.summaries() == [{"group": "te:b", "state": "aside", "bytes": 0,
                               "reason": "its load device and offload device are both cpu"}]


def _encoder() -> torch.nn.Module:
    """A text encoder's mix of tensors at 240 MiB: three 64 MiB projections (glibc maps each on its
    own) and 384 small tensors of up to 256 KiB (glibc keeps those in its heap once freed)."""
    torch.manual_seed(1)
    return torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(3)),
                               *(torch.nn.Linear(256, 256) for _ in range(192)))


@pytest.mark.parametrize("state", ["unloaded", "loaded", "loaded_with_backup", "dropped"])
def test_weight_cache_release_reports_the_rss_it_gives_back(state: str) -> None:
    """What the weight cache's release reports as freed is what the process's RSS drops, in each state ComfyUI
    can leave the model in:

    * ``unloaded``: ComfyUI's unload moved the weights to the host and the cache homed them, so the module's
      host weights *are* the cache's buffers; a release can free none of it (it stays as the module's
      weights, unpinned where pinned);
    * ``loaded``: ComfyUI's next load moved the weights off the host (to the GPU; here to ``meta``, which
      leaves nothing on the host either): the buffers are the cache's alone, all of it is freed;
    * ``loaded_with_backup``: loaded with a LoRA: ComfyUI's patcher keeps the unpatched weights (the
      cache's buffers) as its ``backup`` while the patched ones are on the GPU, so those stay;
    * ``dropped``: ComfyUI dropped the model: the buffers are the cache's alone.
    """
    mod = _encoder()
    want = {n: t.clone() for n, t in caches.named_tensors(mod).items()} if state == "unloaded" else None
    wc = WeightCache()
    assert wc.home("te:enc", ("te", "enc"), mod) == "homed"
    held = wc.bytes_held()
    backup: dict[str, torch.Tensor] = {}
    if state == "loaded_with_backup":
        backup = {n: t.data for n, t in caches.named_tensors(mod).items() if n.startswith(("0.", "3."))}
    if state in ("loaded", "loaded_with_backup"):
        mod.to("meta")
    elif state == "dropped":
        del mod
    before = _rss()
    freed = wc.release("te:enc")
    dropped = before - psutil.Process().memory_info().rss
    kept = {"unloaded": held, "loaded": 0, "dropped": 0,
            "loaded_with_backup": sum(t.nbytes for t in backup.values())}[state]
    assert held > 200 << 20 and abs(dropped - freed.freed_bytes) <= RSS_TOLERANCE, (state, dropped, freed)
    assert freed.kept_bytes == kept, (held, freed)
    if not PINNED:
        assert freed == Freed(held - kept, 0, kept), (held, freed)
    if want is not None:  # the module kept its weights
        assert all(torch.equal(t, want[n]) for n, t in caches.named_tensors(mod).items())


def test_digest_refuses_objects_it_cannot_key_by_content() -> None:
    class Opaque:
        pass
    with pytest.raises(TypeError, match="cannot key"):
        digest({"a": Opaque()})
    assert digest(torch.float16, torch.device("cpu")) != digest(torch.bfloat16, torch.device("cpu"))


def test_caches_report_to_the_status_route() -> None:
    caches.register_status()
    st = get_hub().status()
    assert isinstance(st["caches"], list) and set(st["text_encoder_outputs"]) >= {"entries", "hits", "misses"}
    assert "text_encoder_outputs" in StatusHub().status()
