"""Lock-step research harness for update modes at many workers (torch only, all N workers batched).

Emulates gradshare's ±τ threshold encoding exactly in torch, per worker: r += x; τ = the calibrated
(1 − density) quantile of a strided sample of |r| (encoding/threshold.py: same stride, same warm-up
ramp to the density as the planner sets it at N workers, driver/plan.py's rule_for); sent = sign(r)·τ where
|r| >= τ; r -= sent; every 5th step r is clipped to ±5τ (ResidualClipping). All N workers' models are
one batched MLP (bmm over a leading worker axis), so N = 64 costs about what one process at batch 4096
costs.
The encoder and the optimizers are in scaling_research_encoding.py.

    python benchmarks/scaling_research.py '{"workload": "tab10", "world": 64, "system": "local"}'

The record of what it measured is docs/design.md, "What we tried: learning at 64 workers". Workloads:
"tab10" is `benchmarks/scaling.py`'s tabular64k, "mnist1d" its mnist1d-mlp (lab/workloads.py).

Systems:
  ddp      dense mean gradient, one Adam (lr)
  dlocal   today's design, dense: each worker's own Adam from P, updates × scale summed
  local    today's design compressed (local view P + r, own Adam, ±τ with EF, messages × scale summed)
  global   workers fold something linear in the data into r, every replica feeds the aggregate of the
           step's decoded messages into ONE shared optimizer (knobs below)
Prints one JSON line: acc per epoch, final3 (mean of the last 3), traffic ratio, seconds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from gradshare.config import TrainConfig
from gradshare.driver.plan import rule_for
from scaling_research_encoding import Adam, Encoder, factored, fused_adam

# ----------------------------------------------------------------------------------------------- data
NAMES = {"tab10": "tabular64k", "mnist1d": "mnist1d-mlp"}  # the workloads of `benchmarks/scaling.py`


def load_workload(name: str, seed: int):
    """(X_train, y_train, X_test, y_test) of lab/workloads.py's workload for `name`."""
    cache = os.environ.get("SR_DATA")  # a folder of <name>_<seed>.npz (machines without the data packages)
    if cache and os.path.exists(os.path.join(cache, f"{name}_{seed}.npz")):
        z = np.load(os.path.join(cache, f"{name}_{seed}.npz"))
        return z["Xtr"], z["ytr"], z["Xte"], z["yte"]
    from lab.workloads import load

    wl = load(NAMES[name], seed)
    return wl.X_train, wl.y_train, wl.X_test, wl.y_test


ARCH = {"tab10": [100, 1024, 512, 10], "mnist1d": [40, 512, 512, 512, 10]}
EPOCHS = {"tab10": 8, "mnist1d": 10}


class MLP:
    """A flat-parameter MLP run for K parameter vectors at once: theta [K, P], X [K, B, in]."""

    def __init__(self, dims, seed, device):
        torch.manual_seed(seed)
        self.dims, self.layout, parts, off = dims, [], [], 0
        for a, b in zip(dims[:-1], dims[1:]):
            lin = torch.nn.Linear(a, b)  # torch's default init, as the real workloads
            parts += [lin.weight.detach().t().reshape(-1), lin.bias.detach()]
            self.layout.append((a, b, off, off + a * b, off + a * b + b))
            off += a * b + b
        self.init = torch.cat(parts).to(device)
        self.n = off

    def logits(self, theta, X, leaves=None):
        K, h = theta.shape[0], X
        for i, (a, b, o0, o1, o2) in enumerate(self.layout):
            W, bias = (
                leaves[2 * i : 2 * i + 2] if leaves else (theta[:, o0:o1].view(K, a, b), theta[:, o1:o2].view(K, 1, b))
            )
            h = torch.baddbmm(bias, h, W)
            if i < len(self.layout) - 1:
                h = torch.relu(h)
        return h

    def grads(self, theta, X, y):
        """Per-row gradient of each row's mean loss over its batch: [K, P]. One leaf per tensor: a
        slice of one [K, P] leaf would make autograd write a full [K, P] zero tensor per slice."""
        K = theta.shape[0]
        leaves = []
        for a, b, o0, o1, o2 in self.layout:
            leaves += [
                theta[:, o0:o1].view(K, a, b).detach().requires_grad_(True),
                theta[:, o1:o2].view(K, 1, b).detach().requires_grad_(True),
            ]
        out = self.logits(theta, X, leaves)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / X.shape[1]
        gs = torch.autograd.grad(loss, leaves)
        g = torch.empty(K, self.n)
        for (a, b, o0, o1, o2), gW, gb in zip(self.layout, gs[0::2], gs[1::2]):
            g[:, o0:o1] = gW.reshape(K, -1)
            g[:, o1:o2] = gb.reshape(K, -1)
        return g

    @torch.no_grad()
    def accuracy(self, p, X, y):
        correct = 0
        for b in range(0, len(y), 8192):
            out = self.logits(p[None], X[None, b : b + 8192])[0]
            correct += int((out.argmax(1) == y[b : b + 8192]).sum())
        return correct / len(y)

    def tensors(self):
        """(slice, rows, cols) of every weight matrix (for factored statistics)."""
        return [(slice(o0, o1), a, b) for a, b, o0, o1, o2 in self.layout]


# ---------------------------------------------------------------------------------------------- run
def run(
    workload="tab10",
    world=64,
    system="local",
    seed=0,
    lr=1e-3,
    batch=64,
    epochs=None,
    density=2e-3,
    scale=1.0,
    exact=False,
    clip=5.0,
    view=True,
    warmup=None,
    warmup_density=None,
    # global-mode knobs
    fold="g",
    vwarm=None,
    beta=0.9,
    nesterov=False,
    mom_mask=True,
    eps=1e-8,
    gclip=0.0,
    factor="rowcol",
    outer_mom=0.0,
    outer_lr=1.0,
    b2=0.999,
    glr=None,
    gview=False,
    nden=0.0,
    # round-2 knobs
    vsrc="frozen",
    vs=None,
    owarm=0,
    dsched=None,
    dmin=None,
    lrcomp=0.0,
    lrcomp_until=None,
    # round-3 knobs
    dsteps=1.0,
    lrfade=False,
    lrlayers=None,
    rdecay=1.0,
    lrend=1.0,
    # round-4 knobs
    trust=0.0,
    trustinit=False,
    trustepoch=False,
    trustglobal=False,
    **extra,
):
    torch.set_num_threads(int(os.environ.get("SR_THREADS", "1")))
    dev = torch.device("cpu")
    Xtr, ytr, Xte, yte = load_workload(workload, seed)
    epochs = epochs or EPOCHS[workload]
    N, B = world, batch
    model = MLP(ARCH[workload], seed, dev)
    P = model.n
    n = len(ytr) - len(ytr) % N
    shard = n // N
    Xs = torch.from_numpy(Xtr[:n]).view(N, shard, -1)
    ys = torch.from_numpy(ytr[:n]).view(N, shard)
    Xte_t, yte_t = torch.from_numpy(Xte), torch.from_numpy(yte)
    spe = math.ceil(shard / B)
    T = spe * epochs
    planned = rule_for(TrainConfig(epochs=epochs, batch_size=B, seed=seed), spe, N)  # what a fit of N workers runs
    wsteps = planned.warmup_steps if warmup is None else int(warmup)
    wdens = planned.warmup_density if warmup_density is None else warmup_density
    gen = torch.Generator(device="cpu")
    p = model.init.clone()
    enc = Encoder(N, P, dev, density, wsteps, wdens, clip=clip, exact=exact) if system in ("local", "global") else None
    accs, t0 = [], time.time()
    S = 1.0 / N if scale == -1 else scale
    VS = S if vs is None else vs  # the local view's residual scale (global modes)
    if enc is not None and dsched is not None:
        kind_, c_ = dsched[0], float(dsched[1])
        if kind_ == "lin":  # linear decay from c to the density over the run
            enc.sched = lambda t: c_ + (density - c_) * t / T
        elif kind_ == "geo":  # geometric decay from c to the density over dsteps × the run (still above
            # the density at the end when dsteps > 1)
            TD = dsteps * T
            enc.sched = lambda t: density * (c_ / density) ** (1.0 - min(t, TD) / TD)
        elif kind_ == "inv":  # c / (steps done so far + 1): a coordinate waits ~steps so far
            enc.sched = lambda t: c_ / (t + 1)
        elif kind_ == "T":  # flat c / T (steps per worker in the run)
            enc.sched = lambda t: c_ / T
        elif kind_ == "rampgeo":  # the warm-up's ramp up to c over the warm-up, then geometric to the density
            enc.sched = lambda t: (
                wdens * (c_ / wdens) ** (t / wsteps)
                if t < wsteps
                else density * (c_ / density) ** (1.0 - (t - wsteps) / max(1, T - wsteps))
            )
    om = torch.zeros(P) if outer_mom else None

    norms0 = {}  # trustinit: the norms of the initial parameters (known identically everywhere)

    def capped(a):  # trust: each tensor's aggregated step at most trust × that tensor's norm (LARS/LAMB-like)
        if not trust:
            return a
        if trustglobal:  # one factor for the whole step: ‖a‖ at most trust × ‖p‖ (init norm with trustinit)
            if "all" not in norms0:
                norms0["all"] = float(model.init.norm())
            na, np_ = float(a.norm()), (norms0["all"] if trustinit else float(p.norm()))
            if na > trust * np_ > 0:
                a *= trust * np_ / na
            return a
        for _, _, o0, o1, o2 in model.layout:
            for sl in (slice(o0, o1), slice(o1, o2)):
                if trustinit and (sl.start, sl.stop) not in norms0:
                    norms0[(sl.start, sl.stop)] = float(model.init[sl].norm())
                if trustepoch and (sl.start, sl.stop, epoch) not in norms0:  # the norms at each epoch's start
                    norms0[(sl.start, sl.stop, epoch)] = float(p[sl].norm())
                na = float(a[sl].norm())
                np_ = (
                    norms0[(sl.start, sl.stop)]
                    if trustinit
                    else norms0[(sl.start, sl.stop, epoch)]
                    if trustepoch
                    else float(p[sl].norm())
                )
                if na > trust * np_ > 0:
                    a[sl] *= trust * np_ / na
        return a

    def outer(a):  # optional outer (SNOO-style) momentum on the aggregated step, shared state
        if om is None:
            return a * outer_lr
        om.mul_(outer_mom).add_(a)
        return (a + outer_mom * om if nesterov else om) * outer_lr

    if system == "ddp":
        pp, opt = fused_adam(p, lr, b2=b2)
    elif system == "local" and nden:
        nadam = Adam((N, P), dev, lr, b2=b2)  # the N-aware denominator (see the step)
    elif system == "local":
        rp, opt = fused_adam(enc.r, lr, b2=b2)  # the optimizer's update lands in r (r += u)
    elif system == "dlocal":
        q = torch.zeros(N, P)
        qp, opt = fused_adam(q, lr, b2=b2)
    elif system == "global":
        vw = wsteps if vwarm is None else int(vwarm)  # steps of the local-mode warm-up that gives v
        rp, opt = fused_adam(enc.r, lr, b2=b2)
        mom = torch.zeros(N, P) if fold in ("m", "dgc", "dgcp") else None
        M = torch.zeros(P)  # momentum on the aggregate: ONE state, identical on every replica
        den = None  # 1 / the shared frozen sqrt(v) (fold "g"/"m"), or None (dgc: plain SGD)
        glr = lr if glr is None else glr
        vo = torch.zeros(P)  # a shared second-moment EMA (oracle: of the dense mean gradient)
        vstate = {"t": 0, "mt": 0}
        if vw == 0:
            del opt
            opt = None
    for t in range(T):
        epoch, b = divmod(t, spe)
        if b == 0:
            gen.manual_seed(seed * 100003 + epoch)
            perm = torch.argsort(torch.rand(N, shard, generator=gen), dim=1)
        idx = perm[:, b * B : (b + 1) * B]
        X = torch.gather(Xs, 1, idx[..., None].expand(-1, -1, Xs.shape[2]))
        y = torch.gather(ys, 1, idx)
        if system == "ddp":
            pp.grad = model.grads(p[None], X.reshape(1, -1, X.shape[2]), y.reshape(1, -1))[0]
            opt.step()
        elif system == "dlocal":
            q.copy_(p.expand(N, P))
            qp.grad = model.grads(q, X, y)
            opt.step()
            p += outer((q - p).sum(0) * S)
        elif system == "local" and nden:
            # each worker's own Adam, its denominator sqrt(v + c(N-1) m^2): the sum of the N updates is
            # then about one Adam step at sqrt(N)·lr on the MEAN gradient, whose second moment is
            # mu^2 + sigma^2/N where each worker's v sees mu^2 + sigma^2 (m^2 estimates mu^2)
            pts = p + enc.r * S if view else p.expand(N, P)
            g = model.grads(pts, X, y)
            a_ = nadam
            a_.t += 1
            a_.m.lerp_(g, 1 - a_.b1)
            a_.v.mul_(a_.b2).addcmul_(g, g, value=1 - a_.b2)
            mh = a_.m / (1 - a_.b1**a_.t)
            den = (a_.v / (1 - a_.b2**a_.t)).addcmul_(mh, mh, value=nden * (N - 1)).sqrt_().add_(a_.eps)
            enc.r.addcdiv_(mh, den, value=-lr)
            del mh, den
            p += outer(enc.encode(t, S))
        elif system == "local" or (system == "global" and t < vw):
            # today's design (and the global modes' warm-up): own Adam at the local view P + S·r
            pts = p + enc.r * S if view else p.expand(N, P)
            rp.grad = model.grads(pts, X, y)
            base_lr = lr * (lrend ** (t / max(1, T - 1)))  # lrend: a geometric ramp of the own-Adam lr to lr·lrend
            opt.param_groups[0]["lr"] = base_lr
            f_ = 1.0
            if lrcomp and (
                lrcomp_until is None or t < lrcomp_until
            ):  # own-Adam lr × (base density / this step's scheduled density)^lrcomp
                dt = enc.target(t) if enc.sched is None else max(enc.target(t), enc.sched(t))
                d_end = max(density, enc.floor)
                a_ = lrcomp
                if (
                    lrfade and enc.sched is not None
                ):  # the power fades with the decay's progress: α·(d_t − d_end)/(d_0 − d_end)
                    d0 = max(enc.target(0), enc.sched(0))
                    a_ = lrcomp * max(0.0, dt - d_end) / max(1e-30, d0 - d_end)
                f_ = (d_end / dt) ** a_
                opt.param_groups[0]["lr"] = base_lr * f_
            if rdecay != 1.0:  # SparseLoCo-style decayed error feedback: old residual mass fades
                enc.r.mul_(rdecay)
            if lrlayers is not None and f_ != 1.0:  # the lr factor only on the listed layers (index into ARCH's layers)
                r0 = enc.r.clone()
            opt.step()
            if lrlayers is not None and f_ != 1.0:
                keep = set(int(i) % len(model.layout) for i in lrlayers)
                for i, (a, b, o0, o1, o2) in enumerate(model.layout):
                    if i not in keep:  # Adam's update is linear in lr: undo the factor on this layer
                        sl = enc.r[:, o0:o2]
                        sl.sub_(r0[:, o0:o2]).mul_(1.0 / f_).add_(r0[:, o0:o2])
                del r0
            p += outer(capped(enc.encode(t, S)))
            if system == "global" and t == vw - 1:
                st = opt.state[rp]
                vbar = st["exp_avg_sq"].mean(0) / (1 - 0.999 ** float(st["step"]))
                if factor == "rowcol" or factor == "scalar":
                    vbar = factored(vbar, model, factor == "rowcol")
                den = 1.0 / (vbar.sqrt() + eps)
                if fold == "m":
                    mom.copy_(st["exp_avg"] / (1 - 0.9 ** float(st["step"])))
                opt.state.clear()
                del opt
        else:  # global, after the warm-up
            g = model.grads(p + enc.r * VS if gview else p.expand(N, P), X, y)
            if gclip:  # DGC's local gradient clipping
                g.mul_((gclip / g.norm(dim=1, keepdim=True)).clamp(max=1.0))
            if vsrc in ("oracle", "ofact", "owarm", "owfact"):
                # ORACLE: the EMA of the dense mean gradient's square (what DDP's Adam would hold);
                # owarm: the same, frozen after the first owarm steps (dense warm-up, counted)
                if vsrc in ("oracle", "ofact") or vstate["t"] < owarm:
                    gm = g.mean(0)
                    vo.mul_(b2).addcmul_(gm, gm, value=1 - b2)
                    vstate["t"] += 1
                    vh = vo / (1 - b2 ** vstate["t"])
                    if vsrc in ("ofact", "owfact"):
                        vh = factored(vh, model)
                        # each worker sends its gradient's row and column sums of squares (approximation
                        # of the factored mean-gradient v: cost counted at rows + cols + biases floats)
                        enc.extra += 4 * sum(a_ + b_ for _, a_, b_ in model.tensors()) + 4 * (
                            P - sum(a_ * b_ for _, a_, b_ in model.tensors())
                        )
                    elif vsrc == "owarm":
                        enc.extra += 4 * P  # a dense mean-gradient exchange in the warm-up
                    den = 1.0 / (vh.sqrt() + eps)
            if fold == "graw":  # raw gradient in r; every replica runs Adam-like on the mean of messages
                enc.r.add_(g)
                a = enc.encode(t, S)
                vstate["mt"] += 1
                M.lerp_(a, 1 - beta)
                mh = M / (1 - beta ** vstate["mt"])
                if vsrc == "agg":  # v from the aggregate stream: EMA of (EMA'd aggregate)^2
                    vo.mul_(b2).addcmul_(mh, mh, value=1 - b2)
                    vstate["t"] += 1
                    den = 1.0 / ((vo / (1 - b2 ** vstate["t"])).sqrt() + eps)
                elif vsrc == "aggraw":  # EMA of the aggregate^2 itself
                    vo.mul_(b2).addcmul_(a, a, value=1 - b2)
                    vstate["t"] += 1
                    den = 1.0 / ((vo / (1 - b2 ** vstate["t"])).sqrt() + eps)
                p.addcmul_(mh, den, value=-glr)
                if (t + 1) % spe == 0:
                    accs.append(model.accuracy(p, Xte_t, yte_t))
                continue
            if fold == "dgc":  # momentum correction: velocity accumulated locally, the residual sums it
                torch.add(g, mom, alpha=beta, out=mom)
                enc.r.add_(mom, alpha=-glr)
                a = enc.encode(t, S, mom=mom if mom_mask else None)
            elif fold == "m":  # 1-bit Adam: local momentum under the shared frozen v, EF-compressed
                mom.lerp_(g, 1 - beta)
                enc.r.addcmul_(mom, den, value=-glr)
                a = enc.encode(t, S, mom=None)
            elif fold == "dgcp":  # Adam-preconditioned DGC: velocity of den·g
                mom.mul_(beta).addcmul_(g, den.expand_as(g))
                enc.r.add_(mom, alpha=-glr)
                a = enc.encode(t, S, mom=mom if mom_mask else None)
            else:  # fold "g": the frozen-v-preconditioned gradient; momentum on the aggregate
                enc.r.addcmul_(g, den, value=-glr)
                a = enc.encode(t, S)
                if beta:
                    vstate["mt"] += 1
                    M.lerp_(a, 1 - beta)
                    a = a * (1 - beta) + beta * M if nesterov else M / (1 - beta ** vstate["mt"])
            p += outer(a)
        if (t + 1) % spe == 0:
            accs.append(model.accuracy(p, Xte_t, yte_t))
            if not math.isfinite(float(p.abs().max())):
                accs += [0.0] * (epochs - len(accs))
                break
    return {
        "acc": [round(100 * a, 2) for a in accs],
        "final3": round(100 * float(np.mean(accs[-3:])), 2),
        "ratio": round(enc.ratio()) if enc else 1,
        "P": P,
        "T": T,
        "sec": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    out = run(**spec)
    print(json.dumps({"spec": spec, **out}), flush=True)
