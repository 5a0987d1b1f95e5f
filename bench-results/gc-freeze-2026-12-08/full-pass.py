"""The router under uvicorn with its tokenizer (as `dpd route`): a full collection timed while it serves
(its startup objects frozen) and after it stopped (unfrozen). Run: PYTHONPATH=. .venv/bin/python THIS"""
import asyncio, gc, time
import dpd.cli as cli
from dpd.router import Router, make_server
args = cli.build_parser().parse_args(["route", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
    "--tokenizer", "/root/.cache/dpd/models/SmolLM2-135M-Instruct-v1", "--port", "18777"])
async def main():
    router = Router(cli.route_settings(args))
    server = make_server(router, "127.0.0.1", 18777, is_embedded=True)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    print("frozen objects:", gc.get_freeze_count(), "tracked now:", len(gc.get_objects()))
    for _ in range(3):
        t = time.perf_counter(); gc.collect(); print("full pass while serving, ms", round((time.perf_counter() - t) * 1000, 2))
    server.should_exit = True
    await task
    print("after stop: frozen", gc.get_freeze_count())
    t = time.perf_counter(); gc.collect(); print("full pass after stop, ms", round((time.perf_counter() - t) * 1000, 1))
asyncio.run(main())
