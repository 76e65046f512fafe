"""Property tests of the index-batch decoder and of the index under lying feeds (hypothesis).

* any bytes, truncated batches and well-formed msgpack of the wrong types: ``decode_message``
  raises ValueError or returns a batch, nothing else;
* batches from workers that lie (removals of blocks they never stored, parents they do not
  hold, parent cycles, other workers' ids, absurd counts), applied through the wire: the index
  stays consistent with a brute-force model of what the batches said.
"""

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.index_publisher import HASH_BYTES, decode_message, encode_batch
from actors.prefix_index import PrefixIndex
from engine.block_pool import BlockEvent

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BS = 4

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 64, 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4) | st.sampled_from(
        ["v", "w", "s", "bs", "d", "e", "snap", "se", "ss"]), kids, max_size=6),
    max_leaves=20)


def _packable(x):
    try:
        return msgpack.packb(x, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return None


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_value_error(data):
    try:
        decode_message(data)
    except ValueError:
        pass


@SETTINGS
@given(msgpack_values)
def test_random_msgpack_raises_only_value_error(value):
    payload = _packable(value)
    if payload is None:
        return
    try:
        decode_message(payload)
    except ValueError:
        pass


VALID = encode_batch("w1", 3, BS, [BlockEvent("stored", b"a" * 16, None, "acme"),
                                   BlockEvent("stored", b"b" * 16, b"a" * 16, "acme"),
                                   BlockEvent("removed", b"b" * 16, b"a" * 16, "acme")],
                     [(b"a" * 16, None, "acme")])


@SETTINGS
@given(st.integers(0, len(VALID) - 1))
def test_truncated_batches_raise_value_error(cut):
    with pytest.raises(ValueError):
        decode_message(VALID[:cut])


FIELD_VALUES = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.text(max_size=3) | st.binary(
    max_size=20) | st.lists(st.integers(-3, 3) | st.binary(max_size=17) | st.none(), max_size=5) | st.floats()


@SETTINGS
@given(st.sampled_from(["v", "w", "s", "bs", "d", "e", "snap", "se", "ss"]), FIELD_VALUES,
       st.integers(0, 2), st.integers(0, 3))
def test_type_wrong_fields_raise_only_value_error(key, value, row, col):
    m = msgpack.unpackb(VALID, raw=False)
    if key == "e" and isinstance(value, (int, str, bytes)) and m["e"]:
        m["e"][row % len(m["e"])][col] = value  # one wrong cell inside an event
    else:
        m[key] = value
    payload = _packable(m)
    if payload is None:
        return
    try:
        batch, _ = decode_message(payload)
    except ValueError:
        return
    for kind, h, p, d in batch.events:  # whatever passes is well-typed
        assert kind in (0, 1) and isinstance(h, bytes) and len(h) == HASH_BYTES and h != p
        assert p is None or (isinstance(p, bytes) and len(p) == HASH_BYTES)
        assert d is None or isinstance(d, str)
    assert isinstance(batch.worker_id, str) and isinstance(batch.seq, int) and batch.block_size > 0


# -- lying feeds -----------------------------------------------------------------------------------
HASHES = [bytes([i]) * 16 for i in range(1, 9)]
h_ = st.sampled_from(HASHES)
event = st.tuples(st.sampled_from(["stored", "removed"]), h_, st.none() | h_, st.sampled_from(["t1", "t2"]))
batch = st.tuples(st.sampled_from(["w1", "w2", "w3"]),  # any worker may claim any id
                  st.integers(0, 3) | st.just(2 ** 62),  # sequence numbers, right or absurd
                  st.lists(event, max_size=8),
                  st.none() | st.lists(st.tuples(h_, st.none() | h_, st.sampled_from(["t1", "t2"])), max_size=5),
                  st.booleans())  # remove the worker afterwards (it died)


class Model:
    """What the batches said, brute force: which worker holds which block; node parent and
    domain as set by the event that created the node."""

    def __init__(self):
        self.held: set[tuple[str, bytes]] = set()
        self.parent: dict[bytes, bytes | None] = {}
        self.domain: dict[bytes, str] = {}
        self.next_seq: dict[str, int] = {}

    def _store(self, w, h, p, d):
        if p == h:
            return
        if not any(x == h for _, x in self.held):
            self.parent[h], self.domain[h] = p, d
        self.held.add((w, h))

    def _gc(self):
        live = {h for _, h in self.held}
        self.parent = {h: p for h, p in self.parent.items() if h in live}

    def apply(self, w, seq, events, snap) -> bool:
        if snap is not None:
            self.held = {x for x in self.held if x[0] != w}
            self._gc()
            for h, p, d in snap:
                self._store(w, h, p, d)
        elif self.next_seq.get(w) != seq:
            return False
        for kind, h, p, d in events:
            if kind == "stored":
                self._store(w, h, p, d)
            else:
                self.held.discard((w, h))
                self._gc()
        self.next_seq[w] = seq + 1
        return True

    def remove_worker(self, w):
        self.held = {x for x in self.held if x[0] != w}
        self.next_seq.pop(w, None)
        self._gc()


def check_consistent(idx: PrefixIndex, model: Model):
    nodes = idx._nodes
    assert set(nodes) == {h for _, h in model.held}
    assert len(idx) == len(set(nodes))  # the shards' count follows every store and delete
    for h, node in nodes.items():
        owners = set(idx._owners(node.workers))
        assert owners == {w for w, x in model.held if x == h}
        assert node.parent == model.parent[h] and node.key == h
        assert h in nodes.shards[h[0]] and nodes[h] is node and nodes.get(h) is node  # in its hash's shard
        full = set()
        for w in owners:
            a, seen = model.parent[h], {h}
            while a is not None and (w, a) in model.held and a not in seen and model.domain[a] == model.domain[h]:
                seen.add(a)
                a = model.parent[a]
            if a is None:
                full.add(w)
        assert set(idx._owners(node.full)) == full, "full = holds the node and every ancestor, all of its domain"
        kids = set(node.children) if type(node.children) is set else {node.children} - {None}
        assert kids == {c for c in nodes.values() if c.parent == h}
    for ph, kids in idx._orphans.items():
        assert ph not in nodes
        kids = kids if type(kids) is set else {kids}
        assert kids and kids == {c for c in nodes.values() if c.parent == ph}
    for w, f in idx._feeds.items():
        assert f.blocks == sum(1 for x, _ in model.held if x == w)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch, min_size=1, max_size=12))
def test_lying_feeds_keep_the_index_consistent(batches):
    idx, model = PrefixIndex(BS), Model()
    for w, seq, events, snap, dies in batches:
        payload = encode_batch(w, seq, BS, [BlockEvent(k, h, p, d) for k, h, p, d in events],
                               None if snap is None else list(snap))
        try:
            b, _ = decode_message(payload)
        except ValueError:  # a self-parent event: the whole batch is refused
            assert any(p == h for _, h, p, _ in events) or any(p == h for h, p, _ in snap or ())
            continue
        assert idx.apply_batch(b) == model.apply(w, seq, events, snap)
        if dies:
            idx.remove_worker(w)
            model.remove_worker(w)
        check_consistent(idx, model)
        # lookups along recorded parent chains equal the brute-force run of each worker
        for h in list(model.parent):
            chain, a, seen = [], h, set()
            while a is not None and a not in seen and a in model.parent:
                seen.add(a)
                chain.append(a)
                a = model.parent[a]
            if a is not None:
                continue  # not rooted: no prompt can reach it
            chain.reverse()
            d = model.domain[chain[0]]
            want = {}
            for w2 in {x for x, _ in model.held}:
                k = 0
                while k < len(chain) and (w2, chain[k]) in model.held and model.domain[chain[k]] == d:
                    k += 1
                if k:
                    want[w2] = k * BS
            assert idx.lookup({d: chain}) == want
