"""The file storage backend: roundtrips, corrupt pages are misses, a restart finds pages, threads, the size cap."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from moeserve.kvcache.storage.file import FileStorage
from moeserve.kvcache.storage.keys import KVLayout, page_keys
from moeserve.kvcache.storage.page_format import HEADER_BYTES, CorruptPage, decode_page, encode_page
from moeserve.kvcache.storage.registry import BACKEND_NAMES, make_storage

ROOT = KVLayout(model="test", dtype="bfloat16", page_size=4, kv_layout="mla:3x(16+8)").root()


def _keys(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return page_keys(ROOT, rng.integers(0, 1000, size=4 * n), 4)


def _page(gen: torch.Generator, dtype: torch.dtype, shape=(3, 4, 24)) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_roundtrip(tmp_path, dtype):
    gen = torch.Generator().manual_seed(hash(str(dtype)) % 2**31)
    store = FileStorage(tmp_path)
    keys = _keys(5)
    pages = [_page(gen, dtype, (i + 1, 4, 24)) for i in range(5)]
    assert store.batch_exists(keys) == 0 and store.get(keys[0]) is None
    for key, page in zip(keys[:3], pages, strict=False):
        store.put(key, page)
    assert store.batch_exists(keys) == 3 and store.batch_exists(keys[1:]) == 2 and store.batch_exists([]) == 0
    for key, page in zip(keys[:3], pages, strict=False):
        got = store.get(key)
        assert got.dtype == dtype and got.shape == page.shape
        assert torch.equal(got.view(torch.uint8), page.view(torch.uint8))  # bit-exact (FP8 has no equal)
    store.put(keys[0], pages[4])  # a key already stored is kept as it is: keys name contents
    assert torch.equal(store.get(keys[0]).view(torch.uint8), pages[0].view(torch.uint8))
    s = store.stats()
    assert s["hits"] == 4 and s["misses"] == 1 and s["puts"] == 3 and s["corrupt"] == 0
    assert s["bytes_written"] == sum(len(encode_page(k, p)) for k, p in zip(keys[:3], pages, strict=False))
    assert s["bytes_read"] == s["bytes_written"] + len(encode_page(keys[0], pages[0]))


def test_page_format_checks():
    gen = torch.Generator().manual_seed(5)
    key = _keys(1)[0]
    page = _page(gen, torch.bfloat16)
    data = encode_page(key, page)
    assert torch.equal(decode_page(key, data), page) and torch.equal(decode_page(key, bytearray(data)), page)
    empty = torch.empty(0, 3, dtype=torch.float32)
    assert decode_page(key, encode_page(key, empty)).shape == (0, 3)
    with pytest.raises(CorruptPage, match="checksum"):
        decode_page(_keys(1, seed=9)[0], data)  # a page stored under another key
    for bad, why in ((b"XXXX" + data[4:], "magic"), (data[:-1], "bytes"), (data[:HEADER_BYTES - 1], "header"),
                     (data + b"\0", "bytes")):
        with pytest.raises(CorruptPage, match=why):
            decode_page(key, bad)
    with pytest.raises(TypeError, match="dtype"):
        encode_page(key, torch.zeros(2, dtype=torch.complex64))


def test_corrupt_pages_are_misses(tmp_path, caplog):
    gen = torch.Generator().manual_seed(1)
    store = FileStorage(tmp_path)
    keys = _keys(4)
    pages = [_page(gen, torch.bfloat16) for _ in keys]
    for key, page in zip(keys, pages, strict=True):
        store.put(key, page)
    flip = store.path_of(keys[0])
    data = bytearray(flip.read_bytes())
    data[len(data) // 2 + 7] ^= 0x10  # one bit of the payload
    flip.write_bytes(bytes(data))
    trunc = store.path_of(keys[1])
    trunc.write_bytes(trunc.read_bytes()[:-5])
    magic = store.path_of(keys[2])
    magic.write_bytes(b"NOPE" + magic.read_bytes()[4:])
    with caplog.at_level("WARNING"):
        assert store.get(keys[0]) is None and store.get(keys[1]) is None and store.get(keys[2]) is None
    assert torch.equal(store.get(keys[3]), pages[3])
    assert sum("corrupt" in r.message for r in caplog.records) == 1  # logged once
    assert store.stats()["corrupt"] == 3 and store.stats()["misses"] == 3
    assert not flip.exists() and not trunc.exists() and not magic.exists()  # deleted, so rewritten by a later put
    assert store.batch_exists(keys) == 0
    store.put(keys[0], pages[0])
    assert torch.equal(store.get(keys[0]), pages[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_read_into_checks_what_get_checks(tmp_path, dtype):
    """read_into reads a page's payload straight into the caller's tensor: bit-exact, counted like get; a corrupt
    or truncated page is a miss and deleted; a page of another layout is a miss and kept; a page stored in another
    shape of the same length is read."""
    gen = torch.Generator().manual_seed(11)
    store = FileStorage(tmp_path)
    keys = _keys(7)
    flat = [_page(gen, dtype, (96,)) for _ in range(4)]
    for key, page in zip(keys, flat, strict=False):
        store.put(key, page)
    store.put(keys[4], _page(gen, dtype, (4, 24)))  # another shape, the same length
    store.put(keys[5], _page(gen, torch.float16 if dtype != torch.float16 else torch.float32, (96,)))  # another dtype
    out = torch.empty(96, dtype=dtype)
    before = store.stats()
    assert store.read_into(keys[0], out) and torch.equal(out.view(torch.uint8), flat[0].view(torch.uint8))
    s = store.stats()
    assert s["hits"] == before["hits"] + 1
    assert s["bytes_read"] == before["bytes_read"] + len(encode_page(keys[0], flat[0]))
    assert not store.read_into(keys[6], out) and store.stats()["misses"] == s["misses"] + 1  # absent
    assert store.read_into(keys[4], out) and torch.equal(out.view(torch.uint8),
                                                           store.get(keys[4]).reshape(-1).view(torch.uint8))
    assert not store.read_into(keys[5], out) and store.path_of(keys[5]).exists()  # kept: not corrupt
    flip, trunc, head = (store.path_of(k) for k in keys[1:4])
    data = bytearray(flip.read_bytes())
    data[-3] ^= 0x04  # a bit of the payload
    flip.write_bytes(bytes(data))
    trunc.write_bytes(trunc.read_bytes()[:-2])
    data = bytearray(head.read_bytes())
    data[HEADER_BYTES - 1] ^= 0x80  # a bit of the stored checksum
    head.write_bytes(bytes(data))
    corrupt = store.stats()["corrupt"]
    for key in keys[1:4]:
        assert not store.read_into(key, out)
    assert store.stats()["corrupt"] == corrupt + 3
    assert not flip.exists() and not trunc.exists() and not head.exists()


def test_restart_finds_pages(tmp_path):
    """A fresh process on the same directory reads what this one wrote, and the other way round."""
    gen = torch.Generator().manual_seed(2)
    keys = _keys(3)
    pages = [_page(gen, torch.bfloat16) for _ in keys]
    FileStorage(tmp_path).put(keys[0], pages[0])
    torch.save({"keys": keys, "pages": pages}, tmp_path / "expect.pt")
    script = (
        "import sys, torch\n"
        "from moeserve.kvcache.storage.file import FileStorage\n"
        f"d = torch.load({str(tmp_path / 'expect.pt')!r})\n"
        f"s = FileStorage({str(tmp_path)!r})\n"
        "assert s.used_bytes > 0 and s.batch_exists(d['keys']) == 1\n"
        "assert torch.equal(s.get(d['keys'][0]), d['pages'][0])\n"
        "s.put(d['keys'][1], d['pages'][1])\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    fresh = FileStorage(tmp_path)
    assert fresh.batch_exists(keys) == 2 and torch.equal(fresh.get(keys[1]), pages[1])


def test_threads(tmp_path):
    """Writers and readers of overlapping keys at once: every read is a miss or exactly the page put."""
    gen = torch.Generator().manual_seed(3)
    keys = _keys(40)
    pages = {k: _page(gen, torch.bfloat16, (2, 4, 64)) for k in keys}
    store = FileStorage(tmp_path)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                key = keys[rng.integers(len(keys))]
                if rng.random() < 0.5:
                    store.put(key, pages[key])
                else:
                    got = store.get(key)
                    if got is not None and not torch.equal(got, pages[key]):
                        wrong.append(key)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors and not wrong
    s = store.stats()
    assert s["corrupt"] == 0 and s["hits"] > 0 and s["puts"] <= len(keys)
    assert not list(tmp_path.rglob(".tmp-*"))
    assert all(torch.equal(store.get(k), pages[k]) for k in keys if store.path_of(k).exists())


def test_size_cap_evicts_least_recent(tmp_path):
    gen = torch.Generator().manual_seed(4)
    keys = _keys(12)
    pages = [_page(gen, torch.float32, (4, 64)) for _ in keys]  # 1 KiB of payload each
    page_bytes = len(encode_page(keys[0], pages[0]))
    store = FileStorage(tmp_path, max_bytes=8 * page_bytes)
    for i in range(8):
        store.put(keys[i], pages[i])
        time.sleep(0.01)  # distinct mtimes
    assert store.used_bytes == 8 * page_bytes and store.batch_exists(keys) == 8
    time.sleep(0.01)
    assert torch.equal(store.get(keys[0]), pages[0])  # a read makes page 0 recent
    store.put(keys[8], pages[8])  # over the cap: down to 90% of it, oldest first
    held = [k for k in keys if store.path_of(k).exists()]
    assert store.used_bytes == len(held) * page_bytes <= 0.9 * 8 * page_bytes
    assert keys[0] in held and keys[8] in held and keys[1] not in held and keys[2] not in held
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvpage")) == store.used_bytes
    assert FileStorage(tmp_path, max_bytes=8 * page_bytes).used_bytes == store.used_bytes  # a restart counts them
    store.put(keys[9], torch.zeros(1000, 100))  # larger than the whole cap: declined
    assert not store.path_of(keys[9]).exists()


def test_registry(tmp_path):
    assert BACKEND_NAMES == ("file", "mooncake")
    store = make_storage("file", f'{{"path": "{tmp_path}", "max_bytes": 4096}}')
    assert isinstance(store, FileStorage) and store.root == tmp_path and store.max_bytes == 4096
    with pytest.raises(ValueError, match="no setting size.*path, max_bytes"):
        make_storage("file", {"path": str(tmp_path), "size": 1})
    with pytest.raises(ValueError, match="unknown KV storage backend 'nfs'"):
        make_storage("nfs")
    with pytest.raises(ValueError, match="not JSON"):
        make_storage("file", "{path")
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        make_storage("file", {"path": str(tmp_path), "max_bytes": 0})
    with pytest.raises(ValueError, match="lowercase hex"):
        store.get("../../etc/passwd")
