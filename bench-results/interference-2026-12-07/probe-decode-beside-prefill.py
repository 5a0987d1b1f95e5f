import sys, time, statistics, threading, requests
from concurrent.futures import ThreadPoolExecutor
from dpd.sim.profile import WorkerClient
key = open(sys.argv[1]).read().strip()
p = WorkerClient("http://127.0.0.1:8100", api_key=key)
d = WorkerClient("http://127.0.0.1:8101", p.model, key)
seed = int(time.time())
p.complete(p.prompt(768, seed), 1)
def run(load_s, n_prompt):
    times = []; span = []
    stop = threading.Event()
    def stream():
        with d.open_stream(d.prompt(8, seed), 4000) as resp:
            for line in resp.iter_lines(chunk_size=None):
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
                if stop.is_set(): return
    windows = []
    with ThreadPoolExecutor(1) as pool:
        f = pool.submit(stream)
        time.sleep(load_s)  # alone
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < load_s:
            i += 1
            s = time.monotonic(); p.complete(p.prompt(n_prompt, seed + i + int(n_prompt)), 1); windows.append((s, time.monotonic()))
        t1 = time.monotonic()
        time.sleep(load_s)
        stop.set(); f.result()
    gaps = [(a, b, b - a) for a, b in zip(times, times[1:])]
    alone = [g for a, b, g in gaps if b <= t0 or a > t1]
    inside = [g for a, b, g in gaps if any(s < b and e > a for s, e in windows)]
    pace = statistics.median(alone)
    for name, gs in (("alone", alone), ("beside prefill", inside)):
        big = [g for g in gs if g > 2.5 * pace]
        gs2 = sorted(gs)
        print(f"{name}: n={len(gs)} median {statistics.median(gs)*1000:.1f} ms p90 {gs2[int(.9*len(gs2))]*1000:.1f} p99 {gs2[int(.99*len(gs2))]*1000:.1f} max {gs2[-1]*1000:.0f}; >2.5x pace: {len(big)} ({100*len(big)/len(gs):.1f}%), mean excess {statistics.fmean([g-pace for g in big])*1000 if big else 0:.0f} ms")
for n in (768, 256):
    print("prompt", n); run(15, n)
