"""Local search for expert placement: swap items between packs (GPUs) while the objective drops.

An item is a replica with a load per time step; a pack is a GPU with a fixed number of slots. Each swap lowers
(objective, duplicate labels, sum of squared loads) strictly, so the search ends, and the objective (the
weighted sum over steps of the largest pack load) never rises. Vectorized over a batch of independent problems.
"""

from __future__ import annotations

import numpy as np

REL_TOL = 1e-9  # improvements smaller than this fraction of the objective are not worth a swap


def local_search(
    slot_item: np.ndarray,  # [B, packs, S] item in each slot
    v: np.ndarray,  # [B, n, T] float64 item loads
    tw: np.ndarray,  # [T]
    labels: np.ndarray,  # [B, n] in [0, num_labels)
    num_labels: int,
    allow_new_dups: bool = True,
    max_swaps: int | None = None,
) -> np.ndarray:
    """Swap items between packs while (objective, duplicate labels, sum of squared loads) drops.

    The key falls strictly with every swap, so this ends; the objective never rises. allow_new_dups=False
    refuses swaps that put a second item of one label in a pack. Returns a new slot_item.
    """
    slot_item = slot_item.copy()
    num_rows, num_packs, per_pack = slot_item.shape
    if num_packs == 1 or per_pack <= 1:  # with one item per pack a swap only renames packs
        return slot_item
    state = SwapState(slot_item, v, tw, labels, num_labels, allow_new_dups)
    max_swaps = 4 * v.shape[1] + 16 if max_swaps is None else max_swaps
    for mode in ("balance", "dedup"):
        active = np.arange(num_rows)
        if mode == "dedup":
            active = active[state.has_dups(active)]
        for _ in range(max_swaps):
            if active.size == 0:
                break
            active = active[state.step(active, mode)]
    return state.slot_item


class SwapState:
    """Packs, their loads and label counts for the local search; step() applies one best swap per row."""

    def __init__(self, slot_item: np.ndarray, v: np.ndarray, tw: np.ndarray, labels: np.ndarray,
                 num_labels: int, allow_new_dups: bool):
        num_rows, num_packs, per_pack = slot_item.shape
        self.slot_item, self.v, self.tw, self.labels = slot_item, v, tw, labels
        self.allow_new_dups = allow_new_dups
        rows = np.arange(num_rows)[:, None]
        flat = slot_item.reshape(num_rows, -1)
        self.pack_of = np.empty_like(flat)  # [B, n]
        self.pack_of[rows, flat] = np.arange(flat.shape[1]) // per_pack
        self.pos_of = np.empty_like(flat)  # [B, n]
        self.pos_of[rows, flat] = np.arange(flat.shape[1]) % per_pack
        item_loads = np.take_along_axis(v, flat[..., None], 1)  # [B, n, T] in slot order
        self.loads = item_loads.reshape(num_rows, num_packs, per_pack, -1).sum(2)  # [B, packs, T]
        self.count = np.zeros((num_rows, num_packs, num_labels), dtype=np.int64)  # [B, packs, labels]
        np.add.at(self.count, (rows, self.pack_of, labels), 1)

    def has_dups(self, rows: np.ndarray) -> np.ndarray:
        return (self.count[rows] >= 2).any((1, 2))

    def _sources(self, rows: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slots whose item may move: (pack [A, S], pos [A, S], usable [A, S])."""
        num_packs, per_pack = self.slot_item.shape[1:]
        loads = self.loads[rows]  # [A, packs, T]
        if mode == "balance":
            peak = loads.max(1, keepdims=True)
            if loads.shape[2] == 1:
                crit = np.argmax(loads[..., 0], 1)
            else:  # the pack that sets the max at the most (weighted) steps, then the heaviest
                total = loads @ self.tw  # [A, packs]
                heaviest = total / np.maximum(total.max(1, keepdims=True), 1e-30)  # in [0, 1], a tie-break
                score = ((loads >= peak) @ self.tw) + 1e-6 * heaviest
                crit = np.argmax(score, 1)
            pack = np.broadcast_to(crit[:, None], (len(rows), per_pack))
            pos = np.broadcast_to(np.arange(per_pack), (len(rows), per_pack))
            return pack, pos, np.ones(pack.shape, dtype=bool)
        # dedup: up to S slots whose label already occurs earlier in the same pack
        lab = np.take_along_axis(self.labels[rows], self.slot_item[rows].reshape(len(rows), -1), 1)
        lab = lab.reshape(len(rows), num_packs, per_pack)
        earlier = np.tril(np.ones((per_pack, per_pack), dtype=bool), -1)  # [q, q'] q' < q
        dup = ((lab[..., :, None] == lab[..., None, :]) & earlier).any(-1).reshape(len(rows), -1)
        first = np.argsort(~dup, axis=1, kind="stable")[:, :per_pack]  # [A, S] flat slot ids
        return first // per_pack, first % per_pack, np.take_along_axis(dup, first, 1)

    def step(self, rows: np.ndarray, mode: str) -> np.ndarray:
        """One best swap for each of rows; returns a mask of the rows that swapped."""
        num_rows = len(rows)
        ar = np.arange(num_rows)
        loads = self.loads[rows]  # [A, packs, T]
        obj = loads.max(1) @ self.tw  # [A]
        src_pack, src_pos, usable = self._sources(rows, mode)  # [A, S]
        src_item = self.slot_item[rows[:, None], src_pack, src_pos]  # [A, S]
        dst_pack = self.pack_of[rows]  # [A, n]
        if loads.shape[2] == 1 and mode == "balance":
            new_obj, d_sq = self._effects_one_step(rows, loads[..., 0], src_pack[:, 0], src_item)
        else:
            new_obj, d_sq = self._effects(rows, loads, src_pack, src_item)
        # change in the number of duplicate labels: x leaves pack a for b, y leaves b for a
        labels = self.labels[rows]  # [A, n]
        count, r = self.count, rows[:, None]  # count [B, packs, labels]
        x = np.take_along_axis(labels, src_item, 1)  # [A, S]
        x_held = count[r, :, x] >= 1  # [A, S, packs]
        cbx = np.take_along_axis(x_held, np.broadcast_to(dst_pack[:, None, :], (*x.shape, len(labels[0]))), 2)
        x_gone = (count[r, src_pack, x] >= 2)[:, :, None]  # [A, S, 1] pack a loses a duplicate of x
        y_gone = (count[r, dst_pack, labels] >= 2)[:, None]  # [A, 1, n] pack b loses a duplicate of y
        gain = x_gone.astype(np.int8) + y_gone
        if mode == "balance":  # one source pack
            cay = (count[r, src_pack[:, :1], labels] >= 1)[:, None]  # [A, 1, n]
        else:
            cay = count[r[:, None], src_pack[:, :, None], labels[:, None, :]] >= 1  # [A, S, n]
        d_dup = cbx.astype(np.int8) + cay - gain
        d_dup[x[:, :, None] == labels[:, None, :]] = 0

        valid = (dst_pack[:, None, :] != src_pack[:, :, None]) & usable[:, :, None]
        tol = REL_TOL * np.maximum(obj, 1e-30)[:, None, None]
        not_worse = new_obj <= obj[:, None, None]
        if mode == "balance":
            sq_tol = tol * np.maximum(obj, 1e-30)[:, None, None]
            ok = (new_obj < obj[:, None, None] - tol) | (not_worse & (d_dup < 0))
            ok |= not_worse & (d_dup == 0) & (d_sq < -sq_tol)
        else:
            ok = not_worse & (d_dup < 0)
        ok &= valid
        if not self.allow_new_dups:
            ok &= d_dup <= 0
        # lexicographic best: lowest objective (within tol), then fewest duplicates, then smallest squares
        best_obj = np.where(ok, new_obj, np.inf).min((1, 2), keepdims=True)
        ok &= new_obj <= best_obj + tol
        best_dup = np.where(ok, d_dup, 127).min((1, 2), keepdims=True)
        ok &= d_dup == best_dup
        pick = np.argmin(np.where(ok, d_sq, np.inf).reshape(num_rows, -1), 1)
        moved = ok.reshape(num_rows, -1)[ar, pick]
        s, j = np.divmod(pick[moved], ok.shape[2])
        self._swap(rows[moved], src_pack[moved, s], src_pos[moved, s], j)
        return moved

    def _effects(self, rows: np.ndarray, loads: np.ndarray, src_pack: np.ndarray,
                 src_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Objective after each swap and the change of the weighted sum of squared loads -> [A, S, n] each."""
        ar = np.arange(len(rows))
        tw = self.tw
        v = self.v[rows]  # [A, n, T]
        dst_pack = self.pack_of[rows]  # [A, n]
        diff = np.take_along_axis(v, src_item[..., None], 1)[:, :, None] - v[:, None]  # [A, S, n, T]
        load_a = loads[ar[:, None], src_pack][:, :, None]  # [A, S, 1, T]
        load_b = np.take_along_axis(loads, dst_pack[..., None], 1)[:, None]  # [A, 1, n, T]
        # the max over packs other than the two that swap: the first of the top three that is neither
        k = min(3, loads.shape[1])
        top = np.argsort(-loads, axis=1)[:, :k]  # [A, k, T]
        top_val = np.take_along_axis(loads, top, 1)
        rest = np.full(diff.shape, -np.inf)
        found = np.zeros(diff.shape, dtype=bool)
        for q in range(k):
            idx = top[:, q][:, None, None]  # [A, 1, 1, T]
            ok = (idx != src_pack[:, :, None, None]) & (idx != dst_pack[:, None, :, None]) & ~found
            rest = np.where(ok, top_val[:, q][:, None, None], rest)
            found |= ok
        new_obj = np.maximum(np.maximum(rest, load_a - diff), load_b + diff) @ tw
        d_sq = (2 * diff * (load_b - load_a + diff)) @ tw
        return new_obj, d_sq

    def _effects_one_step(self, rows: np.ndarray, loads: np.ndarray, crit: np.ndarray,
                          src_item: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """_effects for one step and the source the most loaded pack crit [A]: loads [A, packs]."""
        ar = np.arange(len(rows))
        v = self.v[rows, :, 0]  # [A, n]
        dst_pack = self.pack_of[rows]  # [A, n]
        diff = np.take_along_axis(v, src_item, 1)[:, :, None] - v[:, None]  # [A, S, n]
        load_a = loads[ar, crit][:, None, None]
        load_b = np.take_along_axis(loads, dst_pack, 1)  # [A, n]
        top = np.argsort(-loads, axis=1, kind="stable")  # top[:, 0] == crit
        second = top[:, 1]
        third_val = loads[ar, top[:, 2]] if loads.shape[1] > 2 else np.full(len(rows), -np.inf)
        rest = np.where(dst_pack == second[:, None], third_val[:, None], loads[ar, second][:, None])  # [A, n]
        new_obj = np.maximum(np.maximum(rest[:, None], load_a - diff), load_b[:, None] + diff)
        d_sq = 2 * diff * (load_b[:, None] - load_a + diff)
        return new_obj, d_sq

    def _swap(self, rows: np.ndarray, pack_a: np.ndarray, pos_a: np.ndarray, item_j: np.ndarray) -> None:
        item_i = self.slot_item[rows, pack_a, pos_a]
        pack_b, pos_b = self.pack_of[rows, item_j], self.pos_of[rows, item_j]
        self.slot_item[rows, pack_a, pos_a], self.slot_item[rows, pack_b, pos_b] = item_j, item_i
        self.pack_of[rows, item_i], self.pack_of[rows, item_j] = pack_b, pack_a
        self.pos_of[rows, item_i], self.pos_of[rows, item_j] = pos_b, pos_a
        diff = self.v[rows, item_i] - self.v[rows, item_j]  # [A, T]
        self.loads[rows, pack_a] -= diff
        self.loads[rows, pack_b] += diff
        x, y = self.labels[rows, item_i], self.labels[rows, item_j]
        np.add.at(self.count, (rows, pack_a, x), -1)
        np.add.at(self.count, (rows, pack_b, x), 1)
        np.add.at(self.count, (rows, pack_b, y), -1)
        np.add.at(self.count, (rows, pack_a, y), 1)
