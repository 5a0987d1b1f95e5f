import sys, time, statistics, threading
from concurrent.futures import ThreadPoolExecutor
from dpd.sim.profile import WorkerClient
key = open(sys.argv[1]).read().strip()
p = WorkerClient("http://127.0.0.1:8100", api_key=key)
d = WorkerClient("http://127.0.0.1:8101", p.model, key)
seed = int(time.time())
p.complete(p.prompt(768, seed), 1)
def prefills(n_prompt, k, base):
    return [p.complete(p.prompt(n_prompt, base + i), 1) for i in range(k)]
def with_streams(b, fn):
    stop = threading.Event()
    def stream(i):
        with d.open_stream(d.prompt(8, seed + 77 * i), 4000) as resp:
            for line in resp.iter_lines(chunk_size=None):
                if stop.is_set(): return
    with ThreadPoolExecutor(b) as pool:
        fs = [pool.submit(stream, i) for i in range(b)]
        time.sleep(1.5)
        try:
            return fn()
        finally:
            stop.set(); [f.result() for f in fs]
for rnd in range(2):
    for n in (768, 256):
        base = seed + 1000 * (rnd + 1) + n
        alone = prefills(n, 4, base)
        b1 = with_streams(1, lambda: prefills(n, 4, base + 100))
        b8 = with_streams(8, lambda: prefills(n, 4, base + 200))
        print(f"round {rnd} prompt {n}: alone {statistics.median(alone):.3f} s; decoder 1 stream {statistics.median(b1):.3f} s; 8 streams {statistics.median(b8):.3f} s")
