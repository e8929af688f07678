from collections import Counter
from scipy.stats import beta as beta_dist

def schedule(b):
    b = max(0.0, min(1.0, float(b)))
    return dict(n_init=max(2, round(2 + 6 * b)), max_branch=min(64, round(4 + 60 * b)), warm_up=max(2, round(2 + 8 * b)),
                abandon_patience=max(3, round(3 + 9 * b)), T_ema=max(2, round(2 + 6 * b)), alpha=0.70 - 0.40 * b,
                conf_thresh=0.85 + 0.12 * b, slack=0.04 - 0.03 * b, trend_thresh=0.04 - 0.03 * b,
                burst_aligned=max(1, round(1 + 2 * b)), widen_burst=max(1, round(1 + 3 * b)),
                min_complete=max(2, round(2 + 3 * b)), max_rounds=500)

def pool_vote(pool):
    if not pool: return None, 0.0
    top = Counter(pool).most_common(2)
    v1, v2 = top[0][1], (top[1][1] if len(top) > 1 else 0)
    return top[0][0], float(1 - beta_dist.cdf(0.5, v1 + 1, v2 + 1))

def plurality(xs):
    return Counter(xs).most_common(1)[0][0] if xs else None

class CMCMethod:
    "Confidence Momentum Controller on the question API; one knob beta in [0, 1]."
    NAME = 'cmc'
    def __init__(self, config=None):
        self.config = dict(config or {})
        self.p = schedule(self.config.get('beta', 0.5))

    def solve(self, question):
        p = self.p
        latest, fin, gone, reads, dis, pool = [], [], [], [], [], []
        def open_branch():
            try: a, _, f = question.probe_new()
            except ValueError: return False
            latest.append(a); fin.append(f); gone.append(False); reads.append(0); dis.append(0)
            if f: pool.append(a)
            return True
        for _ in range(p['n_init']):
            if not open_branch(): break
        if not latest: return None
        ema, window = 0.0, []
        for step in range(p['max_rounds']):
            winner, conf = pool_vote(pool)
            warm = step >= p['warm_up']
            ema = (1 - p['alpha']) * ema + p['alpha'] * conf
            window.append(ema)
            if len(window) > p['T_ema']: window.pop(0)
            if warm and winner is not None:
                live = [i for i in range(len(latest)) if not gone[i] and not fin[i]]
                for i in live: dis[i] = dis[i] + 1 if latest[i] != winner else 0
                cands = sorted([i for i in live if dis[i] >= p['abandon_patience']], key=lambda i: -dis[i])
                for i in cands[:max(0, len(live) - 2)]: gone[i] = True
            live = sorted([i for i in range(len(latest)) if not gone[i] and not fin[i]], key=lambda i: -reads[i])
            for i in live:
                aligned = warm and winner is not None and latest[i] == winner
                for _ in range(p['burst_aligned'] if aligned else 1):
                    if fin[i]: break
                    latest[i], fin[i] = question.probe_more(i); reads[i] += 1
                    if fin[i]: pool.append(latest[i])
            winner, conf = pool_vote(pool)
            ema = (1 - p['alpha']) * ema + p['alpha'] * conf
            window[-1] = ema
            delta = window[-1] - window[0] if len(window) >= 2 else 0.0
            if warm and len(pool) >= p['min_complete'] and ema >= p['conf_thresh'] and delta >= -p['slack']:
                return winner
            if all(fin[i] or gone[i] for i in range(len(latest))): break
            if (len(latest) < p['max_branch'] and delta <= p['trend_thresh'] and step >= max(1, p['warm_up'] // 2)
                    and ema < p['conf_thresh']):
                for _ in range(p['widen_burst']):
                    if len(latest) >= p['max_branch'] or not open_branch(): break
        w = plurality(pool)
        if w is None: w = plurality([latest[i] for i in range(len(latest)) if not gone[i]])
        return w
