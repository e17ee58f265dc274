"""The batch planner's CP-SAT model over a `BatchLayout`: variables, constraints, goals, hints.

Variables per node copy j and device g: how many pods of each single-GPU class go to g; for a
k-GPU class, how many such pods go to j (`z`) and how many of their shares land on g (`s`, with
s <= z and sum_g s = k z: this always splits into z pods on k distinct devices). Device memory and
replicas, node CPU and memory are hard constraints: the plan never overcommits. Copies of a node
class and identical devices inside a node are ordered (symmetry breaking).

Goals (solved by `batch_solve` as `staged` stages): `unplaced`, the priority-weighted pods left
out; then `stranded_goal`, FGD's expected stranded VRAM over the most common pending types
(free memory a type cannot use, or all of a node's free memory when the type cannot run there),
then empty GPUs opened, then nodes touched. The stranded term needs many more variables, so it is
built only when its stage runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from extender.planner.batch_layout import BatchLayout, device_key, stranded_unit

__all__ = ["BatchModel", "build_model", "decisions", "hints", "plan_hint", "stranded_goal"]

Expr = cp_model.LinearExprT
#: per device of a copy: (local index, device row, bytes placed, pods placed, replicas free, bytes free)
_DevInfo = tuple[int, int, Expr, Expr, int, int]
#: per copy that may get pods: (copy, its first node row, devices, CPU terms, memory terms)
_CopyInfo = tuple[int, int, list[_DevInfo], list[Expr], list[Expr]]


@dataclass(frozen=True)
class BatchModel:
    """The model as built (`build_model`). `x[p, copy, device]`: pods of single-GPU class p on a
    device, or shares of a k-GPU class; `z[p, copy]`: pods of a GPU-less or k-GPU class on the
    copy. `aux`: variables whose hint follows from x/z (`(var, terms, is_bool)`: the sum of the
    terms, or whether it is positive)."""

    layout: BatchLayout
    model: cp_model.CpModel
    x: dict[tuple[int, int, int], cp_model.IntVar]
    z: dict[tuple[int, int], cp_model.IntVar]
    unplaced: Expr
    aux: list[tuple[cp_model.IntVar, list[cp_model.IntVar], bool]]
    touched: list[cp_model.IntVar]
    opened: list[cp_model.IntVar]
    copy_info: list[_CopyInfo]


def build_model(lay: BatchLayout) -> BatchModel:
    """Variables and hard constraints over the layout's copies, and the first goal."""
    a, cap, m = lay.a, lay.cap, cp_model.CpModel()
    P = len(lay.classes)
    placed_terms: list[list[cp_model.IntVar]] = [[] for _ in range(P)]
    x: dict[tuple[int, int, int], cp_model.IntVar] = {}
    z: dict[tuple[int, int], cp_model.IntVar] = {}
    opened: list[cp_model.IntVar] = []
    touched: list[cp_model.IntVar] = []
    prev_copy: dict[int, cp_model.IntVar] = {}
    copy_info: list[_CopyInfo] = []
    aux: list[tuple[cp_model.IntVar, list[cp_model.IntVar], bool]] = []
    for ci, cp in enumerate(lay.copies):
        n0 = cp.nodes[0]
        devs = cp.devices
        dev_bytes: list[list[Expr]] = [[] for _ in devs]
        dev_count: list[list[cp_model.IntVar]] = [[] for _ in devs]
        pods_here: list[cp_model.IntVar] = []
        cpu_terms: list[Expr] = []
        mem_terms: list[Expr] = []
        for p, pc in enumerate(lay.classes):
            if not lay.usable[p, n0]:
                continue
            n_p = len(pc.members)
            d = pc.demand
            if pc.k == 0:
                v = m.new_int_var(0, n_p, f"z{p}_{ci}")
                z[p, ci] = v
                placed_terms[p].append(v)
                pods_here.append(v)
                cpu_terms.append(d.cpu_milli * v)
                mem_terms.append(d.memory_bytes * v)
                continue
            if pc.k == 1:
                tot = []
                for li, g in enumerate(devs):
                    if not lay.fit[p, g]:
                        continue
                    need = int(lay.need[p, g])
                    ub = min(n_p, int(a.replicas[g] - a.used_replicas[g]))
                    if need > 0:
                        ub = min(ub, int((a.capacity[g] - a.used[g]) // need))
                    if ub <= 0:
                        continue
                    v = m.new_int_var(0, ub, f"x{p}_{ci}_{li}")
                    x[p, ci, li] = v
                    dev_bytes[li].append(need * v)
                    dev_count[li].append(v)
                    tot.append(v)
                if tot:
                    placed_terms[p].extend(tot)
                    pods_here.extend(tot)
                    cpu_terms.append(d.cpu_milli * sum(tot))
                    mem_terms.append(d.memory_bytes * sum(tot))
                continue
            # k-GPU class: z pods on this node, s shares per device (each <= z, total k z)
            fits = [li for li, g in enumerate(devs) if lay.fit[p, g]]
            if len(fits) < pc.k:
                continue
            ub = min(
                n_p,
                len(fits)
                // pc.k
                * max(1, min(int(a.replicas[devs[li]] - a.used_replicas[devs[li]]) for li in fits)),
            )
            zv = m.new_int_var(0, ub, f"z{p}_{ci}")
            z[p, ci] = zv
            shares = []
            for li in fits:
                g = devs[li]
                need = int(lay.need[p, g])
                sub = min(ub, int(a.replicas[g] - a.used_replicas[g]))
                if need > 0:
                    sub = min(sub, int((a.capacity[g] - a.used[g]) // need))
                s = m.new_int_var(0, max(0, sub), f"s{p}_{ci}_{li}")
                m.add(s <= zv)
                x[p, ci, li] = s
                dev_bytes[li].append(need * s)
                dev_count[li].append(s)
                shares.append(s)
            m.add(sum(shares) == pc.k * zv)
            placed_terms[p].append(zv)
            pods_here.append(zv)
            cpu_terms.append(d.cpu_milli * zv)
            mem_terms.append(d.memory_bytes * zv)
        if not pods_here:
            continue
        if cpu_terms:
            m.add(sum(cpu_terms) <= int(cap.cpu_free[n0]))
            m.add(sum(mem_terms) <= int(cap.mem_free[n0]))
        t = m.new_bool_var(f"t{ci}")
        m.add(sum(pods_here) <= len(lay.demands) * t)
        touched.append(t)
        npods = m.new_int_var(0, len(lay.demands), f"np{ci}")
        m.add(npods == sum(pods_here))
        aux.append((t, list(pods_here), True))
        aux.append((npods, list(pods_here), False))
        # symmetry: copies of a class are used in order of decreasing pod count
        if cp.index > 0 and cp.cls in prev_copy:
            m.add(prev_copy[cp.cls] >= npods)
        prev_copy[cp.cls] = npods
        # devices: memory, replicas, opened, symmetric identical devices
        devinfo: list[_DevInfo] = []
        prev_dev_bytes: Expr | None = None
        for li, g in enumerate(devs):
            free0 = int(a.capacity[g] - a.used[g])
            rep0 = int(a.replicas[g] - a.used_replicas[g])
            used_b: Expr = sum(dev_bytes[li]) if dev_bytes[li] else 0
            used_n: Expr = sum(dev_count[li]) if dev_count[li] else 0
            if dev_bytes[li]:
                m.add(used_b <= max(free0, 0))
                m.add(used_n <= max(rep0, 0))
                if a.used_replicas[g] == 0:
                    o = m.new_bool_var(f"o{ci}_{li}")
                    m.add(used_n <= max(rep0, 1) * o)
                    m.add(used_b <= max(free0, 1) * o)  # bytes link: LP bound ~ volume / GPU size
                    opened.append(o)
                    aux.append((o, list(dev_count[li]), True))
            same_as_prev = li > 0 and device_key(a, devs[li - 1]) == device_key(a, g)
            if same_as_prev and prev_dev_bytes is not None and dev_bytes[li]:
                m.add(prev_dev_bytes >= used_b)
            prev_dev_bytes = used_b if dev_bytes[li] else None
            devinfo.append((li, g, used_b, used_n, rep0, free0))
        copy_info.append((ci, n0, devinfo, cpu_terms, mem_terms))
    for p, pc in enumerate(lay.classes):
        if placed_terms[p]:
            m.add(sum(placed_terms[p]) <= len(pc.members))
    unplaced = sum(
        pc.weight * (len(pc.members) - sum(placed_terms[p])) for p, pc in enumerate(lay.classes)
    )
    return BatchModel(lay, m, x, z, unplaced, aux, touched, opened, copy_info)


def stranded_goal(bm: BatchModel) -> Expr:
    """The second goal, its variables added to the model: expected stranded VRAM after the plan
    on every node copy that may get pods, then empty GPUs opened, then nodes touched."""
    lay, m = bm.layout, bm.model
    cap, frag, w = lay.cap, lay.frag, lay.frag.w
    unit = stranded_unit(lay)
    stranded_terms: list[tuple[int, cp_model.IntVar]] = []
    for ci, n0, devinfo, cpu_terms, mem_terms in bm.copy_info:
        free_after = []
        for li, g, used_b, used_n, rep0, free0 in devinfo:
            if isinstance(used_b, int):
                fa = m.new_constant(max(free0, 0) // unit)
            else:  # free after, in units (rounded down)
                fa = m.new_int_var(0, max(free0, 0) // unit, f"f{ci}_{li}")
                m.add(fa * unit <= max(free0, 0) - used_b)
                m.add(fa * unit >= max(free0, 0) - used_b - unit + 1)
            free_after.append((li, g, fa, used_n, rep0, free0))
        for ti, t_idx in enumerate(lay.types):
            k_t = int(w.gpu_count[t_idx])
            run = m.new_bool_var(f"run{ci}_{ti}")
            if cpu_terms:
                m.add(sum(cpu_terms) <= int(cap.cpu_free[n0]) - int(w.cpu[t_idx])).only_enforce_if(
                    run
                )
            if not cpu_terms and (int(cap.cpu_free[n0]) < int(w.cpu[t_idx])):
                m.add(run == 0)
            if mem_terms:
                m.add(sum(mem_terms) <= int(cap.mem_free[n0]) - int(w.mem[t_idx])).only_enforce_if(
                    run
                )
            if not mem_terms and (int(cap.mem_free[n0]) < int(w.mem[t_idx])):
                m.add(run == 0)
            oks = []
            for li, g, fa, used_n, rep0, free0 in free_after:
                okv: cp_model.IntVar | bool | None
                if k_t == 0:
                    okv = None
                else:
                    static = frag.match[g, t_idx] and frag.need_ok[g, t_idx]
                    need_t = int(frag.need[g, t_idx])
                    if not static or free0 < need_t or rep0 < 1:
                        okv = False
                    else:
                        okv = m.new_bool_var(f"ok{ci}_{li}_{ti}")
                        m.add(fa * unit >= need_t).only_enforce_if(okv)
                        if not isinstance(used_n, int):
                            m.add(used_n <= rep0 - 1).only_enforce_if(okv)
                        oks.append(okv)
                if okv is False:
                    continue  # contributes nothing usable: all its free memory is stranded for t
                # usable[g,t] <= fa, <= cap*ok, <= cap*run
                uv = m.new_int_var(0, max(free0, 0) // unit, f"u{ci}_{li}_{ti}")
                m.add(uv <= fa)
                m.add(uv == 0).only_enforce_if(run.negated())
                if isinstance(okv, cp_model.IntVar):
                    m.add(uv == 0).only_enforce_if(okv.negated())
                stranded_terms.append((-int(lay.tw[ti]), uv))
            if k_t > 0:
                if len(oks) < k_t:
                    m.add(run == 0)
                else:
                    m.add(sum(oks) >= k_t).only_enforce_if(run)
        for _li, _g, fa, _used_n, _rep0, _free0 in free_after:
            stranded_terms.append((int(lay.tw.sum()), fa))
    stranded = sum(c * v for c, v in stranded_terms)
    w_t = len(bm.touched) + 1
    w_s = (len(bm.opened) + 1) * w_t
    return w_s * stranded + w_t * sum(bm.opened) + sum(bm.touched)


def decisions(bm: BatchModel) -> list[cp_model.IntVar]:
    """The variables a plan is read back from (and its hint given in)."""
    return list(bm.x.values()) + list(bm.z.values())


def hints(bm: BatchModel, values: Mapping[int, int]) -> Iterator[tuple[cp_model.IntVar, int]]:
    """A hint for every decision variable and every `aux` one, from the decisions' `values`
    (variable index -> value; missing: 0), so CP-SAT starts from the complete (feasible) plan."""
    for v in decisions(bm):
        yield v, values.get(v.index, 0)
    for var, terms, is_bool in bm.aux:
        total = sum(values.get(t.index, 0) for t in terms)
        yield var, (1 if total > 0 else 0) if is_bool else total


def plan_hint(bm: BatchModel) -> dict[int, int] | None:
    """The layout's greedy plan as values of x/z (by copy): node rows of a class go to copies by
    pod count; identical devices of a node are permuted so their loads do not increase, as the
    symmetry breaking wants. None when the plan uses a node or device the model leaves out."""
    lay = bm.layout
    a = lay.a
    cls_of_pod: dict[int, int] = {}
    for p, pc in enumerate(lay.classes):
        for i in pc.members:
            cls_of_pod[i] = p
    by_node: dict[int, list[int]] = defaultdict(list)
    for i, ch in lay.greedy.items():
        by_node[ch[1]].append(i)
    copies_of: dict[int, list[int]] = defaultdict(list)
    for ci, cp in enumerate(lay.copies):
        copies_of[cp.cls].append(ci)
    node_cls = {}
    for cp in lay.copies:
        for n in cp.nodes:
            node_cls[n] = cp.cls
    vals: dict[int, int] = {}
    per_cls_nodes: dict[int, list[int]] = defaultdict(list)
    for n in by_node:
        if n not in node_cls:
            return None
        per_cls_nodes[node_cls[n]].append(n)
    for c, nodes in per_cls_nodes.items():
        nodes.sort(key=lambda n: -len(by_node[n]))
        if len(nodes) > len(copies_of[c]):
            return None
        for n, ci in zip(nodes, copies_of[c]):
            devs = lay.copies[ci].devices
            actual = lay.dev_order[n]
            # device loads on this node (bytes) for symmetric ordering of identical devices
            load: dict[int, int] = defaultdict(int)
            counts: dict[tuple[int, int], int] = defaultdict(int)
            zc: dict[int, int] = defaultdict(int)
            for i in by_node[n]:
                res = lay.greedy[i][0]
                p = cls_of_pod[i]
                if res is None:
                    zc[p] += 1
                    continue
                if lay.classes[p].k >= 2:
                    zc[p] += 1
                for dev_id, b in zip(res.device_ids, res.bytes_per_device):
                    g = lay.cap.ledger.row(a.node_names[n], dev_id)
                    assert g is not None, "a greedy plan reserves devices of the ledger"
                    li = actual.index(g)
                    load[li] += b
                    counts[p, li] += 1
            # permute identical devices so loads are non-increasing inside each run of them
            perm = list(range(len(devs)))
            li = 0
            while li < len(devs):
                lj = li
                while lj + 1 < len(devs) and device_key(a, actual[lj + 1]) == device_key(
                    a, actual[li]
                ):
                    lj += 1
                block = sorted(range(li, lj + 1), key=lambda q: -load[q])
                for pos, q in zip(range(li, lj + 1), block):
                    perm[q] = pos
                li = lj + 1
            for (p, lq), cnt in counts.items():
                v = bm.x.get((p, ci, perm[lq]))
                if v is None:
                    return None
                vals[v.index] = vals.get(v.index, 0) + cnt
            for p, cnt in zc.items():
                zv = bm.z.get((p, ci))
                if zv is None:
                    return None
                vals[zv.index] = cnt
    return vals
