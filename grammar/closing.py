"""How soon can the output end? A byte automaton of a program, for budget-aware masks.

Every program the front end writes (a regex, its shared terminals, the rules of a recursive
schema) becomes a *recursive transition network*: one byte-level NFA per text (Thompson 1968),
where a terminal or rule reference is a call edge (push the return state, enter the callee) and a
machine's final state returns. Character classes become UTF-8 byte sequences (every code point
but the surrogates, split into ranges of equal encoded length, as Rust's ``utf8-ranges`` does).

A *configuration* is an NFA state with its return stack; the matcher's position is a set of them,
interned lazily as the states of a byte-level DFA (subset construction on demand, Rabin and Scott
1959). For every NFA state the shortest completion in bytes is known (a fixpoint of Dijkstra's
algorithm over the machines, where a call costs its callee's shortest string, Knuth 1977 for the
context-free case), so a DFA state's distance is the minimum over its configurations of the state's
distance plus those of the return states on its stack; its *witness* is one shortest completion,
as bytes.

Bytes bound tokens from above only where every byte is a token: SmolLM2's vocabulary lacks 21
single bytes (controls, 0xC0/0xC1, 0xF5-0xFF, two 4-byte lead bytes). So the distances that
budgets use are in *tokens*: the length of the least tokenization of the witness (a shortest path
over the vocabulary's byte trie), which is a real token sequence that the grammar accepts, and so a
true upper bound for every vocabulary kind.

Intersections (``&``: a pattern with length bounds or a format) are product automata of their two
operands, built when the grammar's automaton is; above ``_MAX_PRODUCT`` pairs (a URI format under a
long ``maxLength``) the grammar is not modelled (``ClosingUnsupported``), nor above
``MAX_NFA_STATES``: such grammars are served without budget-aware masks. So are complements
(``a & ~b``, from ``not: {pattern}``): their right side would have to be determinized.
"""

from __future__ import annotations

import functools
import heapq
import re
import re._constants as sre_c
import re._parser as sre_parse
import threading
from collections import deque

import numpy as np

from stencil.grammar.base import Program
from stencil.grammar.charclass import UnmodelledClass, class_ranges, complement_ranges
from stencil.grammar.vocab import TokenVocabulary

MAX_NFA_STATES = 400_000
EXACT_END_BYTES = 1 << 16  # ends longer than this are counted by their bytes at admission (compiled.py)
_MAX_PRODUCT = 100_000  # pairs of an intersection's product (more: no budget rule)
MAX_STACK = 64  # deeper configurations are dropped (a subset: distances stay upper bounds)
MAX_CONFIGS = 4096  # configurations kept per DFA state, nearest ends first (the same kind of subset)
INF = 1 << 30

_REF = re.compile("\ue000(\\d+)\ue001")
_TERM = re.compile("\ue002(\\d+)\ue003")


class ClosingUnsupported(ValueError):
    """The program uses a construct the closing automaton does not model."""


# -- UTF-8 -----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _utf8_paths(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The byte-range sequences of every code point range of ``ranges`` (:func:`_utf8_ranges`), once
    per distinct class: a schema's regex repeats its few classes (a JSON string's character)
    thousands of times."""
    return tuple(tuple(seq) for lo, hi in ranges for seq in _utf8_ranges(lo, hi))


def _utf8_ranges(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of [lo, hi]."""
    out: list[list[tuple[int, int]]] = []
    for a, b in _split_surrogates(lo, hi):
        for start, end in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF)):
            s, e = max(a, start), min(b, end)
            if s <= e:
                out.extend(_split_same_length(s, e))
    return out


def _split_surrogates(lo: int, hi: int):
    if hi < 0xD800 or lo > 0xDFFF:
        return [(lo, hi)]
    parts = []
    if lo < 0xD800:
        parts.append((lo, 0xD7FF))
    if hi > 0xDFFF:
        parts.append((0xE000, hi))
    return parts


def _split_same_length(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    n = len(chr(lo).encode())
    if n == 1:
        return [[(lo, hi)]]
    # Split until every position's bytes vary independently (the standard recursive split).
    for k in range(1, n):
        m = (1 << (6 * k)) - 1
        if lo & ~m != hi & ~m:
            if lo & m != 0:
                return _split_same_length(lo, lo | m) + _split_same_length((lo | m) + 1, hi)
            if hi & m != m:
                return _split_same_length(lo, (hi & ~m) - 1) + _split_same_length(hi & ~m, hi)
    a, b = chr(lo).encode(), chr(hi).encode()
    return [[(a[i], b[i]) for i in range(n)]]


# -- the network -----------------------------------------------------------------------------------

class _Net:
    """All machines' NFA states: byte edges, epsilon edges, call edges."""

    def __init__(self):
        self.byte_edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.calls: list[list[tuple[int, int]]] = []  # (callee machine, return state)
        self.machine_of: list[int] = []
        self.starts: list[int] = []  # machine → start state
        self.finals: list[int] = []  # machine → final state
        self._machine = 0

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ClosingUnsupported(f"the byte automaton would exceed {MAX_NFA_STATES} states")
        self.byte_edges.append([])
        self.eps.append([])
        self.calls.append([])
        self.machine_of.append(self._machine)
        return len(self.eps) - 1

    def new_machine(self) -> int:
        self.starts.append(-1)
        self.finals.append(-1)
        return len(self.starts) - 1


def _callees_first(net: _Net) -> list[int] | None:
    """The machines of ``net`` ordered so that each comes after every machine it calls, or None
    when some machine calls itself, directly or through others (recursion)."""
    callees: list[set[int]] = [set() for _ in net.starts]
    for s, calls in enumerate(net.calls):
        for callee, _ in calls:
            callees[net.machine_of[s]].add(callee)
    order: list[int] = []
    state = [0] * len(net.starts)  # 0 unseen, 1 on the path, 2 placed
    for root in range(len(net.starts)):
        if state[root]:
            continue
        stack = [(root, iter(callees[root]))]
        state[root] = 1
        while stack:
            m, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                state[m] = 2
                order.append(m)
            elif state[nxt] == 1:
                return None
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(callees[nxt])))
    return order


class _Builder:
    """Thompson construction over ``re._parser`` trees; references are calls."""

    def __init__(self, net: _Net, machine_of_ref: dict[tuple[str, int], int], terminals=()):
        self.net = net
        self.refs = machine_of_ref  # ("rule"|"term", number) → machine
        self.terminals = terminals

    def _product(self, left: str, right: str) -> tuple[int, int]:
        """The intersection of two regexes (no rule references) as a product NFA over bytes: each
        operand built alone (terminals written out), then the pairs of states reachable from the
        pair of starts, a byte edge where both sides have one on overlapping ranges."""
        sides = []
        for text in (left, right):
            if "\ue000" in text:
                raise ClosingUnsupported("a rule inside an intersection")
            scratch = _Net()
            scratch.new_machine()
            b = _Builder(scratch, {}, self.terminals)
            scratch._machine = 0
            b.machine(0, _expand_terms(text, self.terminals))
            sides.append(scratch)
        x, y = sides
        net = self.net
        ids: dict[tuple[int, int], int] = {}
        todo = [(x.starts[0], y.starts[0])]
        ids[todo[0]] = net.state()
        while todo:
            p, q = todo.pop()
            here = ids[(p, q)]
            succ: list[tuple[str, int, int, tuple[int, int]]] = []
            succ += [("eps", 0, 0, (t, q)) for t in x.eps[p]]
            succ += [("eps", 0, 0, (p, t)) for t in y.eps[q]]
            for lo1, hi1, t1 in x.byte_edges[p]:
                for lo2, hi2, t2 in y.byte_edges[q]:
                    lo, hi = max(lo1, lo2), min(hi1, hi2)
                    if lo <= hi:
                        succ.append(("byte", lo, hi, (t1, t2)))
            for kind, lo, hi, pair in succ:
                if pair not in ids:
                    if len(ids) > _MAX_PRODUCT:
                        raise ClosingUnsupported("an intersection too large to model")
                    ids[pair] = net.state()
                    todo.append(pair)
                if kind == "eps":
                    net.eps[here].append(ids[pair])
                else:
                    net.byte_edges[here].append((lo, hi, ids[pair]))
        final = (x.finals[0], y.finals[0])
        end = net.state()
        if final in ids:
            net.eps[ids[final]].append(end)
        return ids[(x.starts[0], y.starts[0])], end

    def machine(self, machine: int, text: str) -> None:
        net = self.net
        net._machine = machine
        marked, names = _mark(text)
        try:
            tree = sre_parse.parse(marked)
        except re.error as e:
            raise ClosingUnsupported(f"cannot parse for the closing automaton: {e}") from None
        groups = {i: n for n, i in tree.state.groupdict.items()}
        start, end = self._seq(list(tree), groups, names)
        net.starts[machine], net.finals[machine] = start, end

    def _seq(self, items, groups, names) -> tuple[int, int]:
        net = self.net
        start = cur = net.state()
        for op, av in items:
            s, e = self._item(op, av, groups, names)
            net.eps[cur].append(s)
            cur = e
        return start, cur

    def _chars(self, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        net = self.net
        start, end = net.state(), net.state()
        for seq in _utf8_paths(tuple(ranges)):
            cur = start
            last = len(seq) - 1
            for i, (blo, bhi) in enumerate(seq):
                nxt = end if i == last else net.state()
                net.byte_edges[cur].append((blo, bhi, nxt))
                cur = nxt
        return start, end

    def _item(self, op, av, groups, names) -> tuple[int, int]:
        net = self.net
        if op is sre_c.LITERAL:
            return self._chars([(av, av)])
        if op is sre_c.NOT_LITERAL:
            return self._chars(complement_ranges([(av, av)]))
        if op is sre_c.ANY:
            return self._chars(complement_ranges([(10, 10)]))
        if op is sre_c.IN:
            return self._chars(_class_ranges(av))
        if op is sre_c.BRANCH:
            start, end = net.state(), net.state()
            for branch in av[1]:
                s, e = self._seq(list(branch), groups, names)
                net.eps[start].append(s)
                net.eps[e].append(end)
            return start, end
        if op is sre_c.SUBPATTERN:
            gid, _, _, sub = av
            name = groups.get(gid)
            if name is not None:
                kind, number = names[name]
                if kind == "and":
                    return self._product(*number)
                if kind == "minus":  # a complement would need the right side determinized
                    raise ClosingUnsupported("a complement is not modelled (not: pattern, string oneOf "
                                             "branches that may overlap, patternProperties beside other "
                                             "open keys, a pattern with a negative lookaround)")
                callee = self.refs.get((kind, number))
                if callee is None:
                    raise ClosingUnsupported(f"unknown {kind} {number}")
                start, ret = net.state(), net.state()
                net.calls[start].append((callee, ret))
                return start, ret
            return self._seq(list(sub), groups, names)
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            items = list(sub)
            start = cur = net.state()
            for _ in range(lo):
                s, e = self._seq(items, groups, names)
                net.eps[cur].append(s)
                cur = e
            if hi == sre_c.MAXREPEAT:
                s, e = self._seq(items, groups, names)
                net.eps[cur].append(s)
                net.eps[e].append(s)
                end = net.state()
                net.eps[cur].append(end)
                net.eps[e].append(end)
                return start, end
            end = net.state()
            net.eps[cur].append(end)
            for _ in range(hi - lo):
                s, e = self._seq(items, groups, names)
                net.eps[cur].append(s)
                net.eps[e].append(end)
                cur = e
            return start, end
        raise ClosingUnsupported(f"regex construct {op} is not modelled")


def _mark(text: str) -> tuple[str, dict[str, tuple]]:
    """``text`` with each reference, and each outermost intersection, as a uniquely named empty
    group ``(?P<nK>)``; ``names[nK]`` says what it stands for."""
    names: dict[str, tuple] = {}
    if "\ue004" in text:
        out, i = [], 0
        while True:
            j = text.find("\ue004", i)
            if j < 0:
                out.append(text[i:])
                break
            depth, k, mid = 0, j, -1
            while True:
                c = text[k]
                if c == "\ue004":
                    depth += 1
                elif c in "\ue005\ue007" and depth == 1:
                    mid = k
                elif c == "\ue006":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            name = f"n{len(names)}"
            kind = "and" if text[mid] == "\ue005" else "minus"
            names[name] = (kind, (text[j + 1:mid], text[mid + 1:k]))
            out.append(text[i:j] + f"(?P<{name}>)")
            i = k + 1
        text = "".join(out)

    def sub(kind: str):
        def f(m: re.Match) -> str:
            name = f"n{len(names)}"
            names[name] = (kind, int(m.group(1)))
            return f"(?P<{name}>)"
        return f

    text = _REF.sub(sub("rule"), text)
    text = _TERM.sub(sub("term"), text)
    return text, names


def _expand_terms(text: str, terminals) -> str:
    """``text`` with terminal references written out (grouped)."""
    seen: dict[int, str] = {}

    def sub(m: re.Match) -> str:
        n = int(m.group(1))
        if n not in seen:
            seen[n] = "(?:" + _TERM.sub(sub, terminals[n]) + ")"
        return seen[n]

    return _TERM.sub(sub, text)


def _class_ranges(items) -> list[tuple[int, int]]:
    try:
        return class_ranges(items)
    except UnmodelledClass as e:
        raise ClosingUnsupported(str(e)) from None


# -- distances and the lazy DFA -----------------------------------------------------------------------

class ClosingAutomaton:
    """Shortest completions of a program, over bytes and tokens (thread-safe).

    Args:
        program: a regex or Lark program from :func:`stencil.grammar.frontend.to_program` (Lark programs
            must come from the JSON Schema compiler: ``rules`` and ``terminals`` given).
        vocab: the grammar alphabet (for token distances and the token walk).
        rules: rule number → regex text (recursive schemas).

    Raises:
        ClosingUnsupported: see the module docstring.
    """

    def __init__(self, program: Program, vocab: TokenVocabulary, rules: dict[int, str] | None = None):
        if program.kind != "regex" and program.root is None:
            raise ClosingUnsupported("a Lark grammar written by hand is not modelled")
        rules = dict(program.rules) if rules is None else rules
        self.vocab = vocab
        self.slack = 0  # largest one-token increase of the token distance seen (budget.py)
        net = self.net = _Net()
        refs: dict[tuple[str, int], int] = {}
        root = net.new_machine()
        texts: list[tuple[int, str]] = [(root, program.text if program.kind == "regex" else program.root)]
        for n, text in enumerate(program.terminals):
            refs[("term", n)] = net.new_machine()
            texts.append((refs[("term", n)], text))
        for n, text in (rules or {}).items():
            refs[("rule", n)] = net.new_machine()
            texts.append((refs[("rule", n)], text))
        builder = _Builder(net, refs, program.terminals)
        for machine, text in texts:
            builder.machine(machine, text)
        self._distances()
        self._lock = threading.Lock()
        self._ids: dict[frozenset, int] = {}
        self._sets: list[frozenset] = []
        self._rows = np.zeros((0, 256), dtype=np.int32)
        self._row_done: list[bool] = []
        self._bdist: list[int] = []
        self._tdist: list[int | None] = []
        self._witness: list[bytes | None] = []
        self._next_tdist: dict[int, np.ndarray] = {}
        self.dead = self._intern(frozenset())
        self.start = self._intern(self._closure({(net.starts[root], ())}))
        self._tokens = token_matrix(vocab)

    # -- static distances ---------------------------------------------------------------------
    def _distances(self) -> None:
        """Each state's distance in bytes to its machine's final state (``_d``), each machine's
        shortest output (``_callee_len``), the bound over configurations, and the successor that
        realises each distance (``_best``, for witnesses).

        Shortest paths backwards from the finals: a byte edge costs 1, an epsilon edge 0, a call
        its callee's shortest output. Where no machine calls itself, even through others, the
        machines are solved callees first, one Dijkstra each over their own states, with every
        call's cost already known (one pass over the net); otherwise all machines at once,
        again until the callees' lengths stop falling (``_distances_fixpoint``). The same
        distances either way (``tests/grammar/test_budget.py`` compares them).
        """
        net = self.net
        order = _callees_first(net)
        if order is None:
            dist, callee_len = self._distances_fixpoint()
        else:
            dist, callee_len = self._distances_by_machine(order)
        self._d = dist
        self._callee_len = callee_len
        self.max_distance = self._max_distance()
        # Successor that realises each state's distance, for witnesses.
        n = len(net.eps)
        best: list[tuple | None] = [None] * n
        for s in range(n):
            if dist[s] >= INF:
                continue
            for lo, hi, t in net.byte_edges[s]:
                if dist[t] + 1 == dist[s]:
                    best[s] = ("byte", lo, hi, t)  # (the byte is picked when a witness is written)
                    break
            if best[s] is None:
                for t in net.eps[s]:
                    if dist[t] == dist[s]:
                        best[s] = ("eps", t)
                        break
            if best[s] is None:
                for callee, ret in net.calls[s]:
                    if callee_len[callee] + dist[ret] == dist[s]:
                        best[s] = ("call", callee, ret)
                        break
        self._best = best

    def _reverse_edges(self) -> list[list[tuple[int, int | None, int]]]:
        """Per state ``t``, the edges into it: ``(source, callee or None, weight)``."""
        net = self.net
        rev: list[list[tuple[int, int | None, int]]] = [[] for _ in range(len(net.eps))]
        for s in range(len(net.eps)):
            for _, _, t in net.byte_edges[s]:
                rev[t].append((s, None, 1))
            for t in net.eps[s]:
                rev[t].append((s, None, 0))
            for callee, ret in net.calls[s]:
                rev[ret].append((s, callee, 0))
        return rev

    def _distances_by_machine(self, order: list[int]) -> tuple[list[int], list[int]]:
        """Distances with the machines solved in ``order`` (every callee before its callers)."""
        net = self.net
        rev = self._reverse_edges()
        dist = [INF] * len(net.eps)
        callee_len = [INF] * len(net.starts)
        calling = {net.machine_of[s] for s, calls in enumerate(net.calls) if calls}
        for m in order:
            final = net.finals[m]
            dist[final] = 0
            if m not in calling:
                # Weights 0 and 1 only: a double-ended queue in place of the heap (0-1 BFS).
                queue = deque([(0, final)])
                while queue:
                    d, t = queue.popleft()
                    if d > dist[t]:
                        continue
                    for s, _, w in rev[t]:
                        cost = d + w
                        if cost < dist[s]:
                            dist[s] = cost
                            if w:
                                queue.append((cost, s))
                            else:
                                queue.appendleft((cost, s))
                callee_len[m] = dist[net.starts[m]]
                continue
            heap = [(0, final)]
            while heap:
                d, t = heapq.heappop(heap)
                if d > dist[t]:
                    continue
                for s, callee, w in rev[t]:  # (edges stay inside a machine: s is in m)
                    cost = d + (w if callee is None else callee_len[callee])
                    if cost < dist[s]:
                        dist[s] = cost
                        heapq.heappush(heap, (cost, s))
            callee_len[m] = dist[net.starts[m]]
        return dist, callee_len

    def _distances_fixpoint(self) -> tuple[list[int], list[int]]:
        """Distances of all machines at once, repeated while the callees' lengths fall (a
        recursive grammar; at most 64 rounds)."""
        net = self.net
        rev = self._reverse_edges()
        callee_len = [INF] * len(net.starts)
        dist = [INF] * len(net.eps)
        for _ in range(64):
            dist = [INF] * len(net.eps)
            heap = [(0, f) for f in net.finals]
            for f in net.finals:
                dist[f] = 0
            heapq.heapify(heap)
            while heap:
                d, t = heapq.heappop(heap)
                if d > dist[t]:
                    continue
                for s, callee, w in rev[t]:
                    cost = d + (w if callee is None else callee_len[callee])
                    if cost < dist[s]:
                        dist[s] = cost
                        heapq.heappush(heap, (cost, s))
            new = [dist[s] for s in net.starts]
            if new == callee_len:
                break
            callee_len = new
        return dist, callee_len

    def _max_distance(self) -> int:
        """An upper bound of every configuration's distance in bytes (``INF`` with recursion): a
        configuration in machine ``c`` called from ``m`` is at most ``max d_c + max d_m`` away,
        so the bound is the heaviest call chain of per-machine maxima."""
        net = self.net
        per: list[int] = [0] * len(net.starts)
        callees: list[set] = [set() for _ in net.starts]
        for s, d in enumerate(self._d):
            m = net.machine_of[s]
            if d < INF:
                per[m] = max(per[m], d)
            for callee, _ in net.calls[s]:
                callees[m].add(callee)
        memo: dict[int, int] = {}
        on_path: set[int] = set()

        def heaviest(m: int) -> int:
            if m in memo:
                return memo[m]
            if m in on_path:
                return INF
            on_path.add(m)
            deepest = max((heaviest(c) for c in callees[m]), default=0)
            on_path.discard(m)
            memo[m] = min(INF, per[m] + deepest)
            return memo[m]

        return heaviest(0)

    def _config_dist(self, state: int, stack: tuple) -> int:
        d = self._d[state]
        for r in stack:
            d += self._d[r]
        return d

    def _closure(self, configs) -> frozenset:
        net = self.net
        out: set = set()
        todo = list(configs)
        while todo:
            c = todo.pop()
            if c in out:
                continue
            state, stack = c
            if self._config_dist(state, stack) >= INF:
                continue  # cannot end from here: drop (keeps sets small)
            out.add(c)
            for t in net.eps[state]:
                todo.append((t, stack))
            if len(stack) < MAX_STACK:
                for callee, ret in net.calls[state]:
                    todo.append((net.starts[callee], stack + (ret,)))
            m = net.machine_of[state]
            if state == net.finals[m] and stack:
                todo.append((stack[-1], stack[:-1]))
        kept = [c for c in out if net.byte_edges[c[0]] or self._accepting_config(c)]
        if len(kept) > MAX_CONFIGS:  # an ambiguous grammar: keep the nearest ends (a subset:
            kept.sort(key=lambda c: self._config_dist(*c))  # distances stay upper bounds)
            kept = kept[:MAX_CONFIGS]
        return frozenset(kept)

    def _accepting_config(self, c) -> bool:
        state, stack = c
        return not stack and state == self.net.finals[0]

    def _intern(self, configs: frozenset) -> int:
        i = self._ids.get(configs)
        if i is not None:
            return i
        i = len(self._sets)
        self._ids[configs] = i
        self._sets.append(configs)
        if i >= self._rows.shape[0]:
            grown = np.zeros((max(64, 2 * self._rows.shape[0]), 256), dtype=np.int32)
            grown[:self._rows.shape[0]] = self._rows
            self._rows = grown
        self._row_done.append(False)
        self._bdist.append(min((self._config_dist(s, st) for s, st in configs), default=INF))
        self._tdist.append(None)
        self._witness.append(None)
        return i

    def _row(self, i: int) -> None:
        """Fill DFA state ``i``'s 256 transitions (lock held)."""
        targets: list[set] = [set() for _ in range(256)]
        net = self.net
        for state, stack in self._sets[i]:
            for lo, hi, t in net.byte_edges[state]:
                for b in range(lo, hi + 1):
                    targets[b].add((t, stack))
        row = [self.dead] * 256
        cache: dict[frozenset, int] = {}
        for b in range(256):
            if targets[b]:
                key = frozenset(targets[b])
                j = cache.get(key)
                if j is None:
                    j = cache[key] = self._intern(self._closure(key))
                row[b] = j
        self._rows[i] = row  # after the interning above, which may have grown the array
        self._row_done[i] = True

    # -- queries ------------------------------------------------------------------------------
    def step(self, i: int, data: bytes) -> int:
        """The DFA state after ``data`` from state ``i`` (``dead`` when refused)."""
        with self._lock:
            for b in data:
                if i == self.dead:
                    return i
                if not self._row_done[i]:
                    self._row(i)
                i = int(self._rows[i, b])
            return i

    def accepting(self, i: int) -> bool:
        return any(self._accepting_config(c) for c in self._sets[i])

    def byte_distance(self, i: int) -> int:
        return self._bdist[i]

    def witness(self, i: int) -> bytes | None:
        """One shortest completion from state ``i`` (bytes), or None from the dead state."""
        with self._lock:
            return self._witness_locked(i)

    def _witness_locked(self, i: int) -> bytes | None:
        if self._witness[i] is not None or i == self.dead:
            return self._witness[i]
        configs = self._sets[i]
        if not configs:
            return None
        state, stack = min(configs, key=lambda c: self._config_dist(*c))
        out = bytearray()
        self._emit(state, out)
        for ret in reversed(stack):
            self._emit(ret, out)
        self._witness[i] = bytes(out)
        return self._witness[i]

    def _emit(self, state: int, out: bytearray) -> None:
        """Append the shortest bytes from ``state`` to its machine's final state."""
        net = self.net
        m = net.machine_of[state]
        guard = 0
        while state != net.finals[m]:
            step = self._best[state]
            guard += 1
            if step is None or guard > 1_000_000:
                raise RuntimeError("closing automaton: no path to the final state")
            if step[0] == "byte":
                out.append(_pick_byte(step[1], step[2]))
                state = step[3]
            elif step[0] == "eps":
                state = step[1]
            else:
                self._emit(net.starts[step[1]], out)
                state = step[2]

    def token_lower_bound(self, i: int) -> int:
        """Tokens an end from ``i`` needs at least: its bytes (known without writing a witness)
        over the longest token's."""
        return -(-self._bdist[i] // max(self._tokens.longest, 1))

    def _beyond(self, i: int, limit: int | None) -> bool:
        """Whether the witness from ``i`` surely takes more than ``limit`` tokens
        (:meth:`token_lower_bound`), when its distance is not known yet."""
        if limit is None or self._tdist[i] is not None:
            return False
        return self.token_lower_bound(i) > limit

    def token_distance(self, i: int, limit: int | None = None) -> int:
        """Tokens of the least tokenization of :meth:`witness` (``INF`` from the dead state): an
        upper bound on the tokens needed to end, met by a real token sequence.

        ``limit``: the caller compares the distance with ``limit`` or less only (a budget's
        tokens left); where the witness's bytes alone show that it needs more, ``limit + 1`` is
        returned without writing or tokenizing it (work in proportion to the witness: a grammar
        whose shortest end is 100,000 bytes away took seconds a step)."""
        if self._beyond(i, limit):
            return limit + 1
        with self._lock:
            d = self._tdist[i]
            if d is None:
                w = self._witness_locked(i)
                d = INF if w is None else self._tokens.count(w)
                self._tdist[i] = d
            return d

    def plan(self, i: int, limit: int | None = None) -> list[int] | None:
        """The token sequence :meth:`token_distance` counts; None where there is none, or (with
        ``limit``) where it surely has more than ``limit`` tokens."""
        if self._beyond(i, limit):
            return None
        w = self.witness(i)
        return None if w is None else self._tokens.tokenize(w)

    def next_token_distances(self, i: int, allowed: np.ndarray | None = None,
                             limit: int | None = None) -> np.ndarray:
        """int32 ``[model_vocab_size]``: the token distance after each token from state ``i``
        (``INF`` where the token is refused; EOS: 0 when ``i`` accepts). Cached per state.

        ``allowed``: bool ``[model_vocab_size]``, the tokens the backend allows from this state
        (its mask); only those are walked (the others are refused by the grammar anyway).
        ``limit``: as in :meth:`token_distance` (distances above it may read ``limit + 1``; such
        a result is not cached)."""
        hit = self._next_tdist.get(i)
        if hit is not None:
            return hit
        states = self._tokens.walk(self, i, allowed)
        # The distance of each state reached, by a table over state numbers (a count of them, not
        # a sort: np.unique's argsort over the whole vocabulary took 6 ms a state, at every step
        # of a structured request whose budget is near, and a grammar's first request meets
        # every state afresh).
        reached = np.flatnonzero(np.bincount(states[states != self.dead]))
        table = np.full(int(states.max()) + 1, INF, dtype=np.int64)
        table[reached] = [self.token_distance(int(s), limit) for s in reached.tolist()]
        capped = any(self._tdist[s] is None for s in reached.tolist())  # (read as limit + 1)
        out = np.minimum(table[states], INF).astype(np.int32)
        out[self._tokens.not_tokens] = INF
        for e in self.vocab.eos_token_ids:
            out[e] = 0 if self.accepting(i) else INF
        if capped or self._beyond(i, limit):
            return out
        finite = out[out < INF]
        if finite.size:
            self.slack = max(self.slack, int(finite.max()) - self.token_distance(i))
        with self._lock:
            if len(self._next_tdist) > 4096:
                self._next_tdist.clear()
            self._next_tdist[i] = out
        return out


def _pick_byte(lo: int, hi: int) -> int:
    """A byte of [lo, hi] for a witness: printable ASCII first (letters, then digits)."""
    for preferred in (ord("a"), ord("0"), ord(" ")):
        if lo <= preferred <= hi:
            return preferred
    for b in range(max(lo, 0x21), min(hi, 0x7E) + 1):
        return b
    return lo


_MATRICES: dict[str, "_TokenMatrix"] = {}
_MATRICES_LOCK = threading.Lock()


def token_matrix(vocab: TokenVocabulary) -> "_TokenMatrix":
    """The vocabulary's token matrix, built once per vocabulary (about 4 MB for 49 k tokens)."""
    with _MATRICES_LOCK:
        m = _MATRICES.get(vocab.fingerprint)
        if m is None:
            m = _MATRICES[vocab.fingerprint] = _TokenMatrix(vocab)
        return m


class _TokenMatrix:
    """The vocabulary as a byte matrix for walking every token through the DFA at once, and the
    least-tokens tokenizer of byte strings."""

    def __init__(self, vocab: TokenVocabulary):
        n = vocab.model_vocab_size
        ids = sorted(vocab.token_bytes, key=lambda t: len(vocab.token_bytes[t]))
        self.order = np.array(ids, dtype=np.int64)  # token ids, shortest first
        self.lengths = np.array([len(vocab.token_bytes[t]) for t in ids], dtype=np.int64)
        width = int(self.lengths.max()) if ids else 0
        mat = np.zeros((len(ids), max(width, 1)), dtype=np.uint8)
        for k, t in enumerate(ids):
            b = vocab.token_bytes[t]
            mat[k, :len(b)] = np.frombuffer(b, dtype=np.uint8)
        self.matrix = mat
        mask = np.ones(n, dtype=bool)
        mask[self.order] = False
        self.not_tokens = np.flatnonzero(mask)
        self.n = n
        self._by_bytes = {b: t for t, b in vocab.token_bytes.items()}
        self._longest = width
        self.longest = width  # bytes of the longest token
        self._last: tuple[bytes, list[int]] | None = None  # the last string ``count`` read, its suffixes' counts

    def walk(self, automaton: ClosingAutomaton, start: int, allowed: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[model_vocab_size]``: the DFA state after each token from ``start`` (tokens
        outside ``allowed``, when given, are left dead)."""
        dead = automaton.dead
        # Only the allowed tokens are walked (their rows, still shortest first): after a key or a
        # number few are, and the others would be carried through every column as dead.
        rows_of = np.arange(len(self.order)) if allowed is None else np.flatnonzero(allowed[self.order])
        lengths = self.lengths[rows_of]
        states = np.full(rows_of.size, start, dtype=np.int64)
        for j in range(self.matrix.shape[1]):
            a = int(np.searchsorted(lengths, j, side="right"))  # the first token longer than j bytes
            if a >= rows_of.size:
                break
            cur = states[a:]
            live = cur != dead
            if not live.any():
                continue
            need = np.flatnonzero(np.bincount(cur[live]))  # the states met (counted, not sorted)
            with automaton._lock:
                for s in need.tolist():
                    if not automaton._row_done[s]:
                        automaton._row(s)
                rows = automaton._rows
            states[a:] = np.where(live, rows[cur, self.matrix[rows_of[a:], j]], dead)
        out = np.full(self.n, dead, dtype=np.int64)
        out[self.order[rows_of]] = states
        return out

    def count(self, data: bytes) -> int:
        """``len(tokenize(data))`` (``INF`` where it is None), with every suffix's count kept
        for the next call: the witness from the state after a token is most often the witness
        before it less that token's bytes (a long counted run, ``a{5000}``), and tokenizing each
        afresh made every step of such a request O(witness) Python work (a 5,000-byte regex
        answer took 169 s; 2,000 bytes 14 s). One backward pass gives the least count of every
        suffix: ``rest[i] = 1 + min rest[i + len(t)]`` over the tokens ``t`` that start ``data[i:]``.
        """
        last = self._last  # (read once: another thread may replace it)
        if last is not None and len(data) <= len(last[0]) and last[0].endswith(data):
            return last[1][len(last[0]) - len(data)]
        n = len(data)
        rest = [INF] * (n + 1)
        rest[n] = 0
        by_bytes, longest = self._by_bytes, self._longest
        for i in range(n - 1, -1, -1):
            best = INF
            for j in range(i + 1, min(n, i + longest) + 1):
                if rest[j] + 1 < best and data[i:j] in by_bytes:
                    best = rest[j] + 1
            rest[i] = best
        self._last = (data, rest)
        return rest[0]

    def tokenize(self, data: bytes) -> list[int] | None:
        """The fewest tokens whose bytes concatenate to ``data`` (shortest path over prefixes),
        or None when the vocabulary cannot spell it."""
        n = len(data)
        best = [INF] * (n + 1)
        back: list[tuple[int, int]] = [(-1, -1)] * (n + 1)
        best[0] = 0
        for i in range(n):
            if best[i] >= INF:
                continue
            for j in range(i + 1, min(n, i + self._longest) + 1):
                t = self._by_bytes.get(data[i:j])
                if t is not None and best[i] + 1 < best[j]:
                    best[j] = best[i] + 1
                    back[j] = (i, t)
        if best[n] >= INF:
            return None
        out, j = [], n
        while j > 0:
            i, t = back[j]
            out.append(t)
            j = i
        return out[::-1]
