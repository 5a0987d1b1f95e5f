import gc, os, sys, time
_t = {}
_path = f"/tmp/gcwatch/log-{os.getpid()}"
def _cb(phase, info):
    if phase == "start":
        _t["s"] = time.perf_counter()
    else:
        d = time.perf_counter() - _t.get("s", time.perf_counter())
        if info["generation"] == 2 or d > 0.005:
            with open(_path, "a") as f:
                f.write(f"{time.time():.3f} gen{info['generation']} {d*1000:.1f}ms collected={info['collected']} argv={' '.join(sys.argv[:3])[:80]}\n")
gc.callbacks.append(_cb)
