"""Turn the walker's constraints into symmetry groups.

1. Coordinates tied by the graph form classes (a union-find with parity: dual ties flip orientation; a class tied
   to its own dual must be orthogonal).
2. Classes that share a parameter axis form a space; pins remove classes, and separations (heads), restriction
   levels and rotary roles refine spaces into blocks that may not mix with each other.
3. Each block gets the intersection of its restrictions as its kind; blocks with the same parameters and shape
   become one group with several copies (the heads of a layer).
4. Head blocks linked to attention heads give the head permutation groups (KV groups, then query heads within).
"""
from __future__ import annotations

import functools

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from ..groups import Group, Member, PinnedSpace, TensorMember
from ..spec import Specs
from .constraints import ORTHOGONAL, Restriction, monomial
from .experts import with_expert_groups
from .head_rows import HeadRows
from .labels import IdSpace
from .naming import common_prefix, role, short_members, unique_ids
from .partition import parity_classes, union_sets
from .scales import scale_groups
from .walk import source_line


@dataclass
class Analysis:
    """What the analysis found: groups, pinned spaces, and ops it did not know."""

    groups: list[Group]
    pinned: list[PinnedSpace]
    unknown_ops: dict[str, int] = field(default_factory=dict)
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    free_outputs: list = field(default_factory=list)  # FreeOutput records (--free-outputs)
    fixed_outputs: list[str] = field(default_factory=list)  # outputs that stay pinned although free ones were asked
    why_unmoved: dict[str, str] = field(default_factory=dict)  # parameter in no group and no pin -> why


class Assembler:
    def __init__(self, walker, specs: Specs):
        self.w, self.specs = walker, specs
        self.ids: IdSpace = walker.ids
        self.c = walker.c
        n = self.ids.next
        self.n = n
        self.is_block = self.ids.block_mask()
        self.is_param = self.ids.param_mask()
        self._classes()
        self._decode_tables()

    # -- 1. classes ------------------------------------------------------------------------------------------
    def _classes(self) -> None:
        n = self.n
        self.cls, self.parity, self.self_dual = parity_classes(n, self.c.ties)
        self.n_cls = int(self.cls.max()) + 1 if n else 0
        # ids grouped by class (ascending within each class), so per-class look-ups cost O(class size)
        self._by_class = np.argsort(self.cls, kind="stable")
        self._class_start = np.searchsorted(self.cls[self._by_class], np.arange(self.n_cls + 1))

    def ids_of(self, classes) -> np.ndarray:
        """Parameter ids (not head-block ids) of the given classes."""
        parts = [self._by_class[self._class_start[c]:self._class_start[c + 1]] for c in np.atleast_1d(classes)]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return ids[self.is_param[ids]]

    def _decode_tables(self) -> None:
        ranges = self.ids.ranges
        self.range_start = np.array([r.start for r in ranges], dtype=np.int64)
        self.range_of = ranges

    def decode(self, ids: np.ndarray):
        k = np.searchsorted(self.range_start, ids, side="right") - 1
        return k, ids - self.range_start[k]

    # -- 2. spaces and blocks -------------------------------------------------------------------------------------
    def analyse(self) -> Analysis:
        """Groups and pinned spaces, with whole experts permuted where isomorphic branches allow it
        (:mod:`symgraph.analysis.experts`)."""
        analysis = with_expert_groups(self, self._analyse_once)
        analysis.why_unmoved = self._why_unmoved(analysis)
        return analysis

    def _analyse_once(self) -> Analysis:
        role = self._rotary_roles()
        self._pin_pieces_cut_elsewhere(role["kind"] > 0, role["pair"] == 1)
        cls_pinned = self._pinned_classes()
        cls_is_head = np.zeros(self.n_cls, bool)
        cls_is_head[self.cls[self.is_block]] = True
        space = self._spaces(cls_is_head)
        key = space.copy()
        key = _refine(self._refine_by_separations(key, role["kind"] > 0), self._passing_signatures())
        restriction = self._class_restrictions()
        excluded = cls_pinned | cls_is_head | (space < 0)
        separated = key
        key = _refine(_refine(separated, restriction.code), role["kind"])
        if self._unsign_split_centred_rows(key, excluded, restriction):
            key = _refine(_refine(separated, restriction.code), role["kind"])
        self._restriction, self._dropped = restriction, {}
        blocks = defaultdict(list)
        for k in np.nonzero(~excluded)[0]:
            blocks[int(key[k])].append(int(k))
        groups = self._coordinate_groups(blocks, restriction, role)
        groups += scale_groups(self, restriction, cls_is_head | (space < 0), role["kind"] > 0)
        groups = unique_ids(groups + self._head_groups(cls_pinned))
        pinned = self._pinned_report(cls_pinned)
        return Analysis(groups, pinned, dict(self.w.unknown_ops), dict(self.w.cap.shapes))

    def _unsign_split_centred_rows(self, key: np.ndarray, excluded: np.ndarray, restriction) -> bool:
        """A centred row (LayerNorm over a width later split into heads) needs T 1 = s 1 with one sign s for the
        whole row, but every block, and every copy of a group, draws its own sign. Where a row spans several
        blocks or meets a pinned coordinate, its blocks keep the sign-free subgroup: permutations (P 1 = 1).
        True when some restriction changed."""
        changed = False
        for rows, node in self.c.centred:
            for row in self.cls[rows]:
                classes = np.unique(row)
                if excluded[classes].any() or len(np.unique(key[classes])) > 1:
                    live = classes[~excluded[classes]]
                    before = restriction.code[live].copy()
                    restriction.meet(live, monomial("one"),
                                     reason=f"one sign for a centred row split into blocks ({node})")
                    changed |= bool((restriction.code[live] != before).any())
        return changed

    def _pin_pieces_cut_elsewhere(self, rotary: np.ndarray, paired: np.ndarray) -> None:
        """Pin the pieces (``self.c.pieces``) whose cuts may keep other coordinates at another input shape, where
        keeping them apart matters: ``cat([h[..., :min(n, 6)] * 2, h[..., min(n, 6):]])`` doubles units 0-4 at the
        traced length 5 and units 0-5 from length 6 on, so a permutation of units 5-11 is no symmetry. The cuts are
        compared with the graphs traced at other shapes (analysis/cuts.py) only where the pieces split coordinates
        outside the rotary pairs: rotate_half's halves are kept apart by the pairs instead, and most models would
        otherwise be traced three more times; pieces that all hold the same coordinates (a token overwritten in
        place) split nothing. A partial rotary's rotated and pass-through pieces are compared: a width that follows
        the input's length pairs other coordinates there (this traces partial-rotary models at the probe shapes).
        So are coordinates joined beside a piece without labels (``self.c.beside_unlabelled``: a rotary over all 4
        dims at the traced length, with the other 0 dims cut off, covers 2 at a shorter one). Each check runs
        once."""
        pending, self.c.cut_pieces = self.c.cut_pieces, []
        for k, cuts_move in pending:
            pieces, node = self.c.pieces[k]
            classes, part = _row_partition([self.cls[p] for p in pieces])
            if len(np.unique(part[~rotary[classes]])) < 2 and (paired[classes].all() or len(np.unique(part)) < 2):
                continue  # every coordinate in every piece (a token overwritten in place), or rotate_half's halves
            self._pin_if_moved(np.concatenate(pieces), node, cuts_move)
        pending, self.c.beside_unlabelled = self.c.beside_unlabelled, []
        for ids, node, cuts_move in pending:
            self._pin_if_moved(ids, node, cuts_move)

    def _pin_if_moved(self, ids: np.ndarray, node: str, cuts_move) -> None:
        why = cuts_move()
        if why is not None:
            self.c.pin(ids, f"cut apart where the cut may fall elsewhere at another input shape ({why})", node)

    def _pinned_classes(self) -> np.ndarray:
        pinned = np.zeros(self.n_cls, bool)
        self.pin_reason: dict[int, tuple[str, str]] = {}
        for ids, reason, node in self.c.pins:
            classes = np.unique(self.cls[ids])
            pinned[classes] = True
            for k in classes:
                self.pin_reason.setdefault(int(k), (reason, node))
        return pinned

    def _spaces(self, cls_is_head: np.ndarray) -> np.ndarray:
        """Classes sharing a parameter axis belong to one space (a connected component)."""
        rows, cols = [], []
        for r in self.range_of:
            if r.block or not r.owner:
                continue
            k = np.unique(self.cls[r.start:r.start + r.size])
            rows.append(k[:-1])
            cols.append(k[1:])
        rows.append(np.arange(self.n_cls))
        cols.append(np.arange(self.n_cls))
        r, c = np.concatenate(rows), np.concatenate(cols)
        graph = coo_matrix((np.ones(len(r), dtype=np.int8), (r, c)), shape=(self.n_cls, self.n_cls))
        _, comp = connected_components(graph, directed=False)
        comp = comp.astype(np.int64)
        comp[cls_is_head] = -1
        return comp

    def _refine_by_separations(self, key: np.ndarray, rotary: np.ndarray) -> np.ndarray:
        """Give the classes of each separated row a key of their own; untouched classes keep theirs. Pieces
        joined after different ops (``self.c.pieces``) leave rotary classes (``rotary``) alone: rotate_half's
        halves are paired coordinates, which the rotary roles keep apart as pairs.

        Costs O(classes touched) per separation, so it scales with the model rather than with layers x model.
        """
        key = key.copy()
        fresh = int(key.max()) + 1 if len(key) else 0
        rows = [(self.cls[r], None) for r, _node in self.c.separates]
        rows += [([self.cls[p] for p in pieces], rotary) for pieces, _node in self.c.pieces]
        for cls_rows, kept_apart in rows:
            classes, part = _row_partition(cls_rows)
            live = key[classes] >= 0
            if kept_apart is not None:
                live &= ~kept_apart[classes]
            classes, part = classes[live], part[live]
            _, new = np.unique(np.stack([key[classes], part], 1), axis=0, return_inverse=True)
            key[classes] = fresh + new.reshape(-1)
            fresh += int(new.max()) + 1 if len(new) else 0
        return key

    def _passing_signatures(self) -> np.ndarray:
        """A code per class for the set of matrices its coordinates pass (0: none). Coordinates of one space that
        pass different matrices (values of heads attended one by one, then joined) may not mix: each set of
        matrices is a block, so every matrix's coordinates stay an invariant subspace of the map."""
        code = np.zeros(self.n_cls, np.int64)
        if self.c.passes:
            matrices: dict[str, int] = {}
            classes, sets = _class_sets(np.concatenate([
                np.stack(np.broadcast_arrays(self.cls[ids], matrices.setdefault(node, len(matrices))), 1)
                for ids, node in self.c.passes]))
            code[classes] = 1 + sets
        return code

    def _class_restrictions(self) -> "RestrictionTable":
        """The meet of every restriction on each class, as small integer codes (millions of classes)."""
        table = RestrictionTable(self.n_cls)
        permute_only = self._permute_only_mask()
        nodes = {n.name: n for n in self.w.cap.graph.nodes}
        for ids, r, why, node, _scales in self.c.restricts:
            if permute_only[ids].all():  # weights that groups only ever permute: their scale limits bind no one
                r = Restriction(r.orthogonal, r.monomial, r.fixes_ones).normalised()  # (Gemma's 1 + w norm weight)
            line = source_line(nodes[node]) if node in nodes else ""
            table.meet(np.unique(self.cls[ids]), r, reason=f"{why} ({node})" + (f" at {line}" if line else ""))
        table.meet(np.unique(self.cls[self.self_dual]), ORTHOGONAL)  # used as x and as its dual (tied embeddings)
        self._permute_only_mask()
        table.meet(np.unique(self.cls[self._moved_weights]), monomial("one"),
                   reason="a weight vector that also moves as a coordinate (a bias, an embedding column) multiplies "
                          "its own coordinate: a scale or sign would count twice")
        return table

    def _rotary_roles(self) -> dict[str, np.ndarray]:
        kind = np.zeros(self.n_cls, np.int64)  # 0 none, 1 pair member, 2 passthrough
        partner = np.full(self.n_cls, -1, np.int64)
        freq = np.full(self.n_cls, -1, np.int64)
        clash = np.zeros(self.n_cls, bool)  # paired otherwise by another rotation (q by halves, k by pairs)
        for com in self.c.commutes:
            if len(com.pairs):
                a, b = self.cls[com.pairs[:, 0]], self.cls[com.pairs[:, 1]]
                for x, y in ((a, b), (b, a)):
                    clash[x] |= (kind[x] == 2) | ((partner[x] >= 0) & (partner[x] != y))
                kind[a] = kind[b] = 1
                partner[a], partner[b] = b, a
                freq[a] = freq[b] = com.frequency
            through = self.cls[com.passthrough]
            clash[through] |= kind[through] == 1
            kind[through] = 2
        return {"kind": np.where(kind > 0, 1, 0), "pair": kind, "partner": partner, "freq": freq, "clash": clash}

    # -- 3. coordinate groups -----------------------------------------------------------------------------------
    def _coordinate_groups(self, blocks, restriction, role) -> list[Group]:
        by_signature: dict[tuple, list] = defaultdict(list)
        for classes in blocks.values():
            described = self._describe_block(classes, restriction, role)
            if described is None:
                continue
            by_signature[described["signature"]].append(described)
        groups = []
        for items in by_signature.values():
            groups.extend(self._emit(items))
        return groups

    def _describe_block(self, classes, restriction, role):
        classes = np.sort(np.array(classes))
        members = self._members_of(classes)
        if not members:
            self._drop(classes, "some parameter holds only part of its block of coordinates, so no map of the "
                                "whole block moves it consistently")
            return None
        anchor = min(members, key=lambda key: (key[1] != 0, key[2] == "permute", key))
        order = np.argsort(members[anchor]["pos"][:, 0])
        classes = classes[order]
        for m in members.values():
            m["pos"] = m["pos"][order]
        r = restriction[classes[0]]
        if role["clash"][classes].any():
            self._drop(classes, "coordinates paired otherwise by another rotation (rotate_half on one side, "
                                "interleaved pairs on the other): no map per pair commutes with both")
            return None
        pairs, passthrough = (), ()
        if role["kind"][classes[0]]:
            where = {int(k): j for j, k in enumerate(classes)}
            seen, pair_list = set(), []
            for j, k in enumerate(classes):
                if role["pair"][k] == 1 and int(role["partner"][k]) in where and j not in seen:
                    jj = where[int(role["partner"][k])]
                    seen |= {j, jj}
                    pair_list.append((min(j, jj), max(j, jj)))
            pairs = tuple(sorted(pair_list))
            passthrough = tuple(j for j, k in enumerate(classes) if role["pair"][k] == 2)
        motif = self.motif_for("coordinates", classes)
        member_sig = tuple(sorted((p, a, act, m["pos"].shape[1]) for (p, a, act), m in members.items()))
        signature = (motif, len(classes), r, pairs, passthrough, member_sig, self._layer_key(members))
        return {"signature": signature, "classes": classes, "members": members, "restriction": r,
                "pairs": pairs, "passthrough": passthrough, "motif": motif, "why": restriction.why(classes)}

    def _layer_key(self, members) -> str:
        return common_prefix([key[0] for key in members])

    def _members_of(self, classes: np.ndarray) -> dict:
        """(param, axis, action) -> positions per class, for every parameter the classes reach.

        The action is the id's orientation relative to the class (dual ties flip it); one parameter axis can hold
        both orientations (a fused QKV weight holds query rows and key rows).
        """
        ids = self.ids_of(classes)
        if len(ids) == 0:  # activation-only coordinates (Funnel's pooled stream): no parameter to transform
            return {}
        rng, pos = self.decode(ids)
        flip = self._class_orientation(classes)
        cls = self.cls[ids]
        action = np.where(self._permute_only_mask()[ids], 2, self.parity[ids] ^ flip[np.searchsorted(classes, cls)])
        order = np.lexsort((pos, np.searchsorted(classes, cls), action, rng))
        rng, pos, cls, action = rng[order], pos[order], cls[order], action[order]
        keys = np.stack([rng, action], 1)
        bounds = np.flatnonzero(np.any(np.diff(keys, axis=0), axis=1)) + 1
        out = {}
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(keys)]):
            k_cls, k_pos = cls[lo:hi], pos[lo:hi]
            counts = np.bincount(np.searchsorted(classes, k_cls), minlength=len(classes))
            if counts.min() == 0 or counts.min() != counts.max():
                return {}  # a parameter covers part of the block: leave the block alone
            r = self.range_of[int(rng[lo])]
            act = ("primal", "dual", "permute")[int(action[lo])]
            out[(r.owner, r.axis, act)] = {"pos": k_pos.reshape(len(classes), counts[0]), "action": act}
        return out

    def _class_orientation(self, classes: np.ndarray) -> np.ndarray:
        """Per class of a (sorted) block: the parity that makes the block's first parameter axis read primal."""
        ids = self.ids_of(classes)
        rng, _ = self.decode(ids)
        anchor = min(((self.range_of[k].axis != 0, self.range_of[k].owner), (self.range_of[k].owner,
                      self.range_of[k].axis)) for k in np.unique(rng))[1]  # rows (producers) read as primal
        at_anchor = np.array([(self.range_of[k].owner, self.range_of[k].axis) == anchor for k in rng])
        flip = np.zeros(len(classes), np.int8)
        where = np.searchsorted(classes, self.cls[ids[at_anchor]])
        flip[where[::-1]] = self.parity[ids[at_anchor]][::-1]  # the lowest id of each class wins
        return flip

    def _permute_only_mask(self) -> np.ndarray:
        """Weight-vector ids that groups only permute. An id whose scale is tied to another coordinate's (a bias
        added to its linear's rows, an embedding column summed into a weight) moves with that coordinate instead:
        it is kept in ``_moved_weights``, and its products keep no scale or sign (:meth:`_class_restrictions`)."""
        if not hasattr(self, "_permute_mask"):
            mask = np.zeros(self.n, bool)
            for ids in self.c.permute_only:
                mask[ids] = True
            scale_cls = parity_classes(self.n, self.c.ties, keep=lambda product: not product)[0]
            moved = np.bincount(scale_cls[~mask], minlength=int(scale_cls.max()) + 1 if self.n else 0) > 0
            self._moved_weights = np.nonzero(mask & moved[scale_cls])[0]
            mask[self._moved_weights] = False
            self._permute_mask = mask
        return self._permute_mask

    def motif_for(self, family: str, classes: np.ndarray) -> str:
        """The motif (specs/motifs.yaml, ``classify``) naming a group of ``family`` over these classes."""
        if not hasattr(self, "_class_tags"):
            tagged = {tag: np.unique(np.concatenate(arrays)) for tag, arrays in self.c.tags.items()}
            untagged = np.zeros(0, np.int64)
            for name, derived in self.specs.derived_tags.items():
                ids = functools.reduce(np.intersect1d, (tagged.get(t, untagged) for t in derived.all))
                tagged[name] = functools.reduce(np.setdiff1d, (tagged.get(t, untagged) for t in derived.none), ids)
            self._class_tags = {}
            for tag, ids in tagged.items():
                mark = np.zeros(self.n_cls, bool)
                mark[self.cls[ids]] = True
                self._class_tags[tag] = mark
        tags = self._class_tags
        return self.specs.motif_for(family, lambda tag: tag in tags and bool(tags[tag][classes].any()))

    def _emit(self, items: list[dict]) -> list[Group]:
        first = items[0]
        motif, r = first["motif"], first["restriction"]
        size = len(first["classes"])
        copies = len(items)
        keys = sorted(first["members"])
        members = []
        for key in keys:
            index = np.stack([it["members"][key]["pos"] for it in items])  # (copies, size, block)
            members.append(Member(key[0], key[1], index, key[2]))
        layer = common_prefix([m.param for m in members])
        base = dict(motif=motif, size=size, copies=copies, members=tuple(members), layer=layer)
        gid = f"{motif}:{layer or 'model'}:{short_members(members)}"
        if first["pairs"]:
            group = self._rotary_group(gid, base, first, r)
            if group is None:
                self._drop_items(items, "rotary pairs limited to one sign shared by all coordinates (" + _why(first)
                                 + "): no rotation or sign per pair is left")
            return [group] if group is not None else []
        kind, scale, global_sign = _kind_of(r)
        if kind == "permutation" and size == 1 and scale is None and not global_sign:
            self._drop_items(items, "a block of one coordinate that may only be permuted (" + _why(first)
                             + "): only the identity is left")
            return []  # the permutations of one coordinate: only the identity
        notes = [f"limited by: {why}" for why in first["why"]]
        full = None
        spec = self.specs.motifs[motif]
        if spec.subgroup is not None and kind == spec.subgroup.of:
            kind, full = spec.subgroup.emit, spec.subgroup.of
            notes.append(spec.subgroup.note)
        if r.fixes_ones and kind == "orthogonal":
            notes.append("restricted to Q with Q 1 = +-1 (LayerNorm centering)")
        groups = [Group(id=gid, kind=kind, scale=scale, global_sign=global_sign, full_group=full,
                        fixes_ones=r.fixes_ones and kind == "orthogonal", notes=tuple(notes), **base)]
        if spec.rescale is not None and full is not None:
            block_members = tuple(Member(m.param, m.axis, m.index.reshape(copies, 1, -1), m.action)
                                  for m in members)
            groups.append(Group(id=f"{motif}-rescale:{layer or 'model'}:{short_members(members)}", motif=motif,
                                kind="scale", size=1, copies=copies, members=block_members, scale="nonzero",
                                layer=layer, links=(gid,), notes=(spec.rescale.note,)))
        return groups

    def _rotary_group(self, gid, base, first, r) -> Group | None:
        pairs, passthrough = first["pairs"], first["passthrough"]
        if r.monomial:
            if r.scale in ("one", "global_sign"):
                return None  # one sign shared by every coordinate (LayerNorm centering) is not a per-pair sign
            scale = {"nonzero": "nonzero", "positive": "positive"}.get(r.scale)
            note = ("rotary pairs restricted by an elementwise weight: one scalar per pair"
                    + ("" if scale else ", sign only"))
            members = tuple(Member(m.param, m.axis, _pair_index(m.index, pairs), m.action) for m in base["members"])
            return Group(id=gid, kind="scale", scale=scale or "sign", notes=(note,),
                         **{**base, "members": members, "size": len(pairs)})
        if r.fixes_ones:
            return None  # Q 1 = +-1 (LayerNorm centering before the rotation) turns no pair but by 0 or all by pi
        scale = None if r.orthogonal else "positive"
        notes = ("SO(2) per frequency pair" + (" times a positive scale" if scale else "")
                 + "; general linear on pass-through coordinates" * bool(passthrough),)
        return Group(id=gid, kind="rotary", scale=scale, rotary_pairs=pairs, passthrough=passthrough,
                     notes=notes, **base)

    # -- 4. heads ---------------------------------------------------------------------------------------------------
    def _head_groups(self, cls_pinned: np.ndarray) -> list[Group]:
        """Permutations of heads, read from the links between head ids and the parameter rows each head uses.

        Works on ids, not classes: the query heads of one KV group share their coordinate classes (one A_g for the
        group) but occupy different rows, and it is rows that a head permutation moves.
        """
        content: dict[int, set[int]] = defaultdict(set)
        read: dict[int, set[int]] = defaultdict(set)  # the ids each head's links name, before factors join them
        ops = []
        factor_of, shared = self._product_factor_components()
        for block_ids, rows, _node in self.c.rowlinks:
            heads = self.cls[block_ids]
            for h, row in zip(heads, rows):
                content[int(h)].update(int(i) for i in factor_of(row[row >= 0]))
                read[int(h)].update(int(i) for i in row[row >= 0])
            ops.append([int(h) for h in np.unique(heads)])
        for h in content:  # parameters tied to the heads themselves (T5 relative-bias columns)
            content[h].update(int(i) for i in self.ids_of(h))
        sharing = self._attach_shared_factors(content, shared, factor_of)
        same = _first_with_same_content(content)  # one block run twice: its heads read the same rows each time
        pinned = {same[h] for h in content if cls_pinned[h]}
        sharing = [{same[h] for h in s} for s in sharing]
        groups = []
        piece_of = [{int(c): k for k, p in enumerate(pieces) for c in np.unique(self.cls[p])}
                    for j, (pieces, _node) in enumerate(self.c.pieces)
                    if j not in self.c.alike_pieces]  # each piece's classes, by the piece they lie in
        parts = union_sets([{same[h] for h in op} for op in ops])  # one op's heads, or ops sharing head classes
        link = self._link_classes()
        together = HeadRows(self.c.taken, sorted(set(same.values())), content, link)
        for joint in union_sets(self._with_content_classes(parts, content, link)):
            heads = sorted(h for h in joint if not isinstance(h, tuple))
            ids = np.fromiter(set().union(*(content[h] for h in heads)), dtype=np.int64)
            if len(heads) < 2 or pinned & set(heads) or cls_pinned[self.cls[ids]].any():
                continue
            if any(s & set(heads) and not s >= set(heads) for s in sharing):
                continue  # a factor shared by some of these heads only would have to stay and move at once
            for alike in self._heads_by_pieces(heads, content, piece_of):  # rotary on half of them: two sets
                if len(alike) > 1:
                    groups.extend(self._head_permutations(alike, content, [p & set(alike) for p in parts
                                                                           if p <= joint and p & set(alike)],
                                                          together, read))
        return groups

    def _heads_by_pieces(self, heads: list[int], content, piece_of: list[dict[int, int]]) -> list[list[int]]:
        """``heads`` split by the pieces of one tensor that different ops joined again (``self.c.pieces``;
        ``piece_of``: the piece of each of their classes) their rows lie in: a head permutation may move a head
        only among the heads that went through the same ops (every head in every piece, as rotate_half's halves
        of each head, moves alike)."""
        classes = [np.unique(self.cls[np.fromiter(content[h], dtype=np.int64)]) for h in heads]
        sets: dict[tuple, list[int]] = defaultdict(list)
        for h, cs in zip(heads, classes):
            sets[tuple(frozenset(owner.get(int(c)) for c in cs) - {None} for owner in piece_of)].append(h)
        return list(sets.values())

    def _with_content_classes(self, parts: list[set[int]], content, cls: np.ndarray) -> list[set]:
        """Each part's heads with the coordinate classes they use (as ``("class", c)``): parts that share a class
        are permuted together. A class two attention ops read (the first layer's values added to every later
        layer's; keys and values one layer computes and another attends to) moves with the heads of both, so the
        heads of one may not be permuted without the other's (``cls``: :meth:`_link_classes`)."""
        linked = []
        for heads in parts:
            ids = np.fromiter(set().union(*(content[h] for h in heads)), dtype=np.int64)
            linked.append(set(heads) | {("class", int(c)) for c in np.unique(cls[ids])})
        return linked

    def _link_classes(self) -> np.ndarray:
        """Classes through which one op's head coordinates reach another's: every tie but the elementwise products
        with a factor entry that scales several coordinates. Such a factor (a RoPE table read from a parameter, a
        weight shared by every head) stays where it is when heads move (``_attach_shared_factors``), so it carries
        nothing from one op's heads to another's; followed, it would join every layer that reads it (RoFormer's
        sinusoidal table: no head group at all)."""
        ties = []
        for a, b, dual, product in self.c.ties:
            if product:
                own = _own_factors(b)
                a, b = a[own], b[own]
            ties.append((a, b, dual, product))
        return parity_classes(self.n, ties)[0]

    def _product_factor_components(self):
        """Map ids to every id that moves with them when a head moves.

        Three kinds of tie lead there: elementwise-product factors (a head's normalised queries lead back to its
        rows of the query projection), weight entries that scale a single coordinate (a q_norm over all heads'
        queries at once: each head owns its slice, which must move with it; a weight shared by every head, as in
        a per-head QK-norm, scales many coordinates and stays), and same-orientation ties between two parameters
        (a bias entry and its weight row). Dual ties are not followed: they join the query heads of a GQA group
        through their shared keys, and those heads move separately.
        """
        edges, shared = [], []
        for a, b, dual, product in self.c.ties:
            if product:  # (output, factor) pairs: a factor entry that scales several outputs is resolved later
                own = _own_factors(b)
                edges.append((a[own], b[own]))
                shared.append((a[~own], b[~own]))
            elif not dual:
                keep = self.is_param[a] & self.is_param[b]
                edges.append((a[keep], b[keep]))
        if not edges:
            return (lambda ids: ids), shared
        r = np.concatenate([a for a, _ in edges])
        c = np.concatenate([b for _, b in edges])
        graph = coo_matrix((np.ones(len(r), dtype=np.int8), (r, c)), shape=(self.n, self.n))
        _, comp = connected_components(graph, directed=False)
        by_comp = np.argsort(comp, kind="stable")
        start = np.searchsorted(comp[by_comp], np.arange(comp.max() + 2))

        def expand(ids):
            return np.concatenate([by_comp[start[k]:start[k + 1]] for k in np.unique(comp[ids])]) \
                if len(ids) else ids
        return expand, shared

    def _attach_shared_factors(self, content, shared, factor_of) -> list[set[int]]:
        """A factor entry that scales several coordinates moves with the one head they all belong to (a per-head
        gate); one that scales coordinates of several heads (a QK-norm weight shared by every head, a RoPE table
        read from a parameter) stays where it is, which is sound only if a permutation moves all of those heads.
        Returns the sets of heads that share a factor."""
        if not content or not any(len(b) for _, b in shared):
            return []
        pairs = np.array([(i, h) for h, ids in content.items() for i in ids], dtype=np.int64)
        order = np.argsort(pairs[:, 0], kind="stable")
        id_sorted, head_sorted = pairs[order, 0], pairs[order, 1]
        sharing: list[set[int]] = []
        for outs, factors in shared:
            lo, hi = np.searchsorted(id_sorted, outs), np.searchsorted(id_sorted, outs, side="right")
            heads_of: dict[int, set[int]] = defaultdict(set)
            for f, a, b in zip(factors.tolist(), lo.tolist(), hi.tolist()):
                heads_of[f].update(head_sorted[a:b].tolist())
            for f, heads in heads_of.items():
                if len(heads) == 1:
                    content[next(iter(heads))].update(int(i) for i in factor_of(np.array([f])))
                elif heads:
                    sharing.append(heads)
        return sharing

    def _head_permutations(self, heads: list[int], content, parts: list[set[int]],
                           together: HeadRows, read: dict[int, set[int]]) -> list[Group]:
        """The permutations of ``heads`` (of several ``parts`` that share coordinates: each part's heads correspond
        to the others' through the rows they share, and one permutation moves them all; no within-group one),
        as far as the rows of statistics that hold several heads ``together`` allow (:mod:`.head_rows`). Query
        heads permute within a KV group only where each reads the same shared rows (``read``: the ids its links
        name) and its own rows are its alone."""
        kv_groups = [sorted(x for x in g if not isinstance(x, tuple))
                     for g in union_sets([{h} | {("id", i) for i in content[h]} for h in heads])]
        kv_groups = sorted((g for g in kv_groups if g), key=lambda g: g[0])
        if len({len(g) for g in kv_groups}) != 1:
            return []
        if len(parts) > 1 and len({tuple(len(p.intersection(g)) for p in parts) for g in kv_groups}) != 1:
            return []  # the parts' heads do not correspond one group to one group
        rep = len(kv_groups[0]) if len(parts) == 1 else 1
        whole, within = together.keep(kv_groups), all(together.keep([[h] for h in g]) for g in kv_groups)
        motif = self.motif_for("heads", np.asarray(heads))
        groups = []
        blocks = self._whole_classes([set().union(*(content[h] for h in g)) for g in kv_groups])
        outer = self._positions_members(blocks) if blocks else []
        if outer and len(kv_groups) > 1 and whole:
            layer = common_prefix([p for m in outer for p in m.params])
            note = "permutes KV groups with their query heads" if rep > 1 else "permutes whole heads"
            groups.append(Group(id=f"{motif}:{layer or 'model'}:{short_members(outer)}", motif=motif,
                                kind="permutation", size=len(kv_groups), copies=1, members=tuple(outer),
                                layer=layer, notes=(note,)))
        if rep > 1 and within:
            per_group = []
            for g in kv_groups:
                shared = set.intersection(*(content[h] for h in g))
                own = [content[h] - shared for h in g]
                if sum(map(len, own)) != len(set().union(*own)) or len({frozenset(read[h] & shared) for h in g}) > 1:
                    # not the query heads of one KV group: heads that share rows with some of their group only, or
                    # read different rows of what they share (each its own values and its neighbour's, summed)
                    per_group = []
                    break
                per_group.append(self._positions_members(own, swaps=False))
            if per_group and all(per_group) and len({tuple((m.param, m.axis) for m in pg) for pg in per_group}) == 1:
                inner = [Member(m.param, m.axis, np.concatenate([pg[k].index for pg in per_group]), "primal")
                         for k, m in enumerate(per_group[0])]
                layer = common_prefix([m.param for m in inner])
                groups.append(Group(id=f"{motif}-within:{layer or 'model'}:{short_members(inner)}", motif=motif,
                                    kind="permutation", size=rep, copies=len(kv_groups), members=tuple(inner),
                                    layer=layer, notes=("permutes query heads within each KV group",)))
        return groups

    def _whole_classes(self, id_sets: list[set[int]]) -> list[set[int]] | None:
        """Each block with the parameter coordinates of its classes that no block holds: a coordinate that
        transforms with one head's coordinates moves with that head (Doge's ``dt_proj`` columns read each head's
        values). One in the classes of every block stays (a QK-norm weight shared by all heads); ``None`` when one
        is in the classes of some blocks only: no permutation of the blocks can then be sound."""
        held = set().union(*id_sets)
        extra = [{int(i) for i in self.ids_of(np.unique(self.cls[np.fromiter(ids, dtype=np.int64)]))} - held
                 for ids in id_sets]
        shared_by_all = set.intersection(*extra)
        extra = [e - shared_by_all for e in extra]
        if sum(map(len, extra)) != len(set().union(*extra)):
            return None
        return [ids | e for ids, e in zip(id_sets, extra)]

    def _positions_members(self, id_sets, swaps: bool = True) -> list[Member | TensorMember]:
        """Members of a permutation of blocks: block j is every parameter position among ``id_sets[j]``, and
        (``swaps``) the tensors it holds whole (:meth:`_swapped_tensors`)."""
        per_key: dict[tuple, list[list[int]]] = defaultdict(lambda: [[] for _ in id_sets])
        for j, ids in enumerate(id_sets):
            ids = np.fromiter(ids, dtype=np.int64)
            ids = ids[self.is_param[ids]]
            rng, pos = self.decode(ids)
            for k, p in zip(rng, pos):
                r = self.range_of[k]
                per_key[(r.owner, r.axis)][j].append(int(p))
        members, own = [], defaultdict(dict)  # own: param -> {axis: the one block holding it}
        for (param, axis), blocks in sorted(per_key.items()):
            lengths = {len(b) for b in blocks}
            if len(lengths) == 1 and 0 not in lengths:
                index = np.array([sorted(b) for b in blocks], dtype=np.int64)[None]
                members.append(Member(param, axis, index, "primal"))
                continue
            holders = [j for j, b in enumerate(blocks) if b]
            everywhere = list(range(self.w.cap.shapes[param][axis]))
            if not swaps or len(holders) != 1 or sorted(blocks[holders[0]]) != everywhere:
                return []
            own[param][axis] = holders[0]
        tensors = self._swapped_tensors(own, len(id_sets))
        return [] if tensors is None else members + tensors

    def _swapped_tensors(self, own: dict[str, dict[int, int]], n: int) -> list[TensorMember] | None:
        """Tensors each held whole, on every axis, by one block (``own``: the block holding each axis), one of each
        role (``norms.*.weight``) and shape per block, each read by one op only: a permutation of the blocks swaps
        them with their blocks (a LayerNorm per head). None when they do not pair up so: a tensor with an axis
        outside its block (a linear per head, whose columns read values that stay) may not move whole."""
        slots: dict[tuple, list] = defaultdict(lambda: [None] * n)
        for param, axes in own.items():
            blocks = set(axes.values())
            key = (role(param), self.w.cap.shapes[param])
            read_once = len(self.w.param_nodes[param].users) == 1
            whole = set(axes) == set(self.w.param_ids[param])
            if len(blocks) != 1 or not (read_once and whole) or slots[key][next(iter(blocks))] is not None:
                return None
            slots[key][next(iter(blocks))] = param
        if any(None in row for row in slots.values()):
            return None
        return [TensorMember((tuple(row),)) for _, row in sorted(slots.items())]

    # -- pinned report -------------------------------------------------------------------------------------------
    def _drop(self, classes, why: str) -> None:
        """Record why the block of ``classes`` gave no group, for the parameters no group moves."""
        for k in np.atleast_1d(classes):
            self._dropped.setdefault(int(k), why)

    def _drop_items(self, items: list[dict], why: str) -> None:
        for it in items:
            self._drop(it["classes"], why)

    def _why_unmoved(self, analysis: Analysis) -> dict[str, str]:
        """For each parameter that no group moves and no pinned space names, the best reason the analysis has:
        why its coordinates' blocks gave no group, else the restrictions that shaped their classes."""
        moved = {p for g in analysis.groups for p in g.params} | {p for s in analysis.pinned for p in s.params}
        owners = defaultdict(list)
        for r in self.range_of:
            if not r.block and r.owner and r.owner not in moved:
                owners[r.owner].append(np.arange(r.start, r.start + r.size))
        out = {}
        for param, ranges in owners.items():
            classes = np.unique(self.cls[np.concatenate(ranges)])
            reasons = list(dict.fromkeys(self._dropped[int(k)] for k in classes if int(k) in self._dropped))
            if not reasons:
                why = self._restriction.why(classes)
                reasons = ["no group was found that moves it" + (f"; limited by: {'; '.join(why)}" if why else "")]
            out[param] = "; ".join(reasons)
        return out

    def _pinned_report(self, cls_pinned: np.ndarray) -> list[PinnedSpace]:
        by_reason: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        ids = np.nonzero(cls_pinned[self.cls] & self.is_param)[0]
        rng, _ = self.decode(ids)
        for i, k in zip(ids, rng):
            reason, node = self.pin_reason.get(int(self.cls[i]), ("pinned", ""))
            by_reason[(reason, node)][self.range_of[k].owner] += 1
        # pinned coordinates per parameter: symgraph.depth replicates a pin that spans repeated blocks from these
        self.pinned_sizes = {key: dict(counts) for key, counts in by_reason.items()}
        nodes = {n.name: n for n in self.w.cap.graph.nodes}
        return [PinnedSpace(tuple(sorted(counts)), sum(counts.values()), key[0], key[1],
                            source_line(nodes[key[1]]) if key[1] in nodes else "")
                for key, counts in sorted(by_reason.items())]


# -- helpers -----------------------------------------------------------------------------------------------------
class RestrictionTable:
    """Per-class restrictions as codes into a small table of distinct :class:`Restriction` values.

    ``table[k]`` is the restriction of class ``k``; ``meet`` intersects classes with one more restriction,
    vectorised over classes (there are few distinct restrictions and many classes).
    """

    def __init__(self, n: int = 0):
        self.values: list[Restriction] = [Restriction()]
        self.code = np.zeros(n, np.int64)
        self.reasons: list[str] = [""]
        self.reason = np.zeros(n, np.int64)  # the last restriction that made each class smaller
        self._meets: dict[tuple[int, Restriction], int] = {}

    def meet(self, classes: np.ndarray, r: Restriction, reason: str = "") -> None:
        if len(classes) == 0:
            return
        before = self.code[classes]
        codes = before.copy()
        for c in np.unique(before):
            codes[before == c] = self._meet_code(int(c), r)
        self.code[classes] = codes
        changed = classes[codes != before]
        if len(changed):
            self.reasons.append(reason)
            self.reason[changed] = len(self.reasons) - 1

    def why(self, classes: np.ndarray) -> list[str]:
        """The restrictions that shaped these classes' group, most common first."""
        counts = np.bincount(self.reason[classes], minlength=len(self.reasons))
        return [self.reasons[i] for i in np.argsort(-counts) if counts[i] and i][:3]

    def _meet_code(self, c: int, r: Restriction) -> int:
        key = (c, r)
        if key not in self._meets:
            value = self.values[c] & r
            if value not in self.values:
                self.values.append(value)
            self._meets[key] = self.values.index(value)
        return self._meets[key]

    def __getitem__(self, k) -> Restriction:
        return self.values[int(self.code[k])]


def _refine(key: np.ndarray, sub: np.ndarray) -> np.ndarray:
    stacked = np.stack([key, sub], axis=1)
    _, inv = np.unique(stacked, axis=0, return_inverse=True)
    out = inv.reshape(-1).astype(np.int64)
    out[key < 0] = -1
    return out


def _row_partition(cls_rows) -> tuple[np.ndarray, np.ndarray]:
    """(classes, block label) for the classes in ``cls_rows`` (an array of rows, or a list of rows of any
    lengths): classes in the same set of rows share a block. A class in several rows (a key shared by every query
    head) is a block of its own, and the rest of each row stays apart from the other rows, so every row remains
    an invariant subspace."""
    if isinstance(cls_rows, list):
        return _class_sets(np.concatenate([np.stack([r.reshape(-1), np.full(r.size, k)], 1)
                                           for k, r in enumerate(cls_rows)]))
    rows = np.broadcast_to(np.arange(len(cls_rows))[:, None], cls_rows.shape)
    return _class_sets(np.stack([cls_rows.reshape(-1), rows.reshape(-1)], 1))


def _class_sets(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(classes, code) from (class, set) pairs: equal codes for classes found in exactly the same sets."""
    pairs = np.unique(pairs, axis=0)  # sorted by class, then set
    classes, start, count = np.unique(pairs[:, 0], return_index=True, return_counts=True)
    code = np.zeros(len(classes), np.int64)
    fresh = 0
    for n in np.unique(count):  # classes in n sets: their sorted set lists as rows of one array
        which = count == n
        _, inv = np.unique(pairs[start[which][:, None] + np.arange(n), 1], axis=0, return_inverse=True)
        code[which] = fresh + inv.reshape(-1)
        fresh += int(inv.max()) + 1
    return classes, code


def _own_factors(factors: np.ndarray) -> np.ndarray:
    """Which (output, factor) pairs of a product tie have a factor entry that scales that one output only."""
    unique, count = np.unique(factors, return_counts=True)
    return np.isin(factors, unique[count == 1])


def _first_with_same_content(content: dict[int, set[int]]) -> dict[int, int]:
    """Each head mapped to the first head whose rows are the same (itself when none is)."""
    first: dict[frozenset, int] = {}
    return {h: first.setdefault(frozenset(content[h]), h) for h in sorted(content)}


def _why(item: dict) -> str:
    return "; ".join(item["why"]) or "no restriction recorded"


def _kind_of(r: Restriction) -> tuple[str, str | None, bool]:
    if r.monomial:
        return {
            "one": ("permutation", None, False),
            "global_sign": ("permutation", None, True),
            "sign": ("signed_permutation", None, False),
            "positive": ("permutation", "positive", False),
            "nonzero": ("permutation", "nonzero", False),
        }[r.scale]
    if r.orthogonal:
        return "orthogonal", None, False
    return "general_linear", None, False


def _pair_index(index: np.ndarray, pairs) -> np.ndarray:
    copies, _, block = index.shape
    cols = np.array(pairs, dtype=np.int64)  # (P, 2)
    return index[:, cols, :].reshape(copies, len(pairs), 2 * block)
