"""The weight cache and the text-encoder output cache (h3ms_async/caches.py), on real tensors and modules."""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from h3ms_async import caches
from h3ms_async.caches import CacheRefused, OutputCache, WeightCache, digest
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
    assert c.clear() == 2 and c.stats()["entries"] == 0 and c.stats()["hits"] == 3
    assert not c.put("k4", out, max_entries=0)  # 0 entries: the cache is off
    assert c.stats()["entries"] == 0


def test_output_cache_honours_the_ram_reserve() -> None:
    c = OutputCache()
    c.put("a", torch.zeros(10), max_entries=8)
    assert not c.put("b", torch.zeros(10), max_entries=8, reserve_gb=1e6)  # no machine keeps 1 PB free
    assert c.stats()["entries"] == 0  # the reserve also evicted what was there


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_output_cache_clear_gives_the_bytes_back() -> None:
    c = OutputCache()
    big = torch.ones(64 << 20)  # 256 MiB
    before = _rss()
    assert c.put("k", (big, {"pooled_output": big[:8]}), max_entries=4)
    stored = weakref.ref(c.get("k")[0])  # a copy: dies at once
    held = c.stats()["bytes"]
    grown = _rss() - before
    assert held == big.nbytes + 32 and grown > 200 << 20, (held, grown)
    assert c.clear() == 1 and c.stats()["bytes"] == 0
    gc.collect()
    assert stored() is None and _rss() - before < 64 << 20, _rss() - before


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
    assert wc.release("te:a") == entry.nbytes and wc.bytes_held() == 0 and wc.summaries() == []
    del entry
    gc.collect()
    assert all(r() is None for r in buffers), "a released copy must not stay referenced"
    assert all(torch.equal(t, want[n]) for n, t in caches.named_tensors(mod).items())
    with pytest.raises(CacheRefused, match="cache_ram_reserve_gb"):
        wc.home("vae:x", ("vae", "x"), mod, reserve_gb=1e6)
    wc.stand_aside("te:b", "its load device and offload device are both cpu")
    assert wc.summaries() == [{"group": "te:b", "state": "aside", "bytes": 0,
                               "reason": "its load device and offload device are both cpu"}]


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
