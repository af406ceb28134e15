"""SGLang's own behaviour across hosts (a recording, not a test): `--language-only` on L
(`SGLANG_HOST_IP` its address, where the encoders push rows) with `--encoder-urls` E1 and E2
(`mmferry serve --store`, store on S); 4 requests with both up, then E1's link cut and 12 at
once: each one's status and time, and how many reached E2.

Run as root: python -m tests.cluster.sglang_partition (about 5 minutes)
"""

import json
import tempfile
import threading
import time
from pathlib import Path

import httpx

import mmferry as mf
from mmferry.testing.cluster import Net
from tests.cluster import mooncake, stack
from tests.engines.sglang_epd import CPU_FLAGS, IMAGE_TOKEN, ffmpeg_env, write_png
from tests.engines.sglang_harness import SGLANG_PYTHON, sglang_env
from tests.engines.tiny_vlm import build_checkpoint, image


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sglang-partition-"))
    net = Net(["s", "e1", "e2", "l"], work).start()
    out = {}
    try:
        model = build_checkpoint("qwen2_5_vl", work / "ckpt")
        f = mf.Processor.from_pretrained(model).config.factor
        media = work / "media"
        media.mkdir(exist_ok=True)
        paths = [write_png(media / f"i{k}.png", image(2 * f, 3 * f, k)) for k in range(16)]
        store = mooncake.Store(net["s"]).start(net)
        urls = {}
        for name in ("e1", "e2"):
            h = net[name]
            args = [
                "-m",
                "mmferry",
                "serve",
                "--model",
                str(model),
                "--host",
                h.addr,
                "--port",
                "0",
                "--shm-mib",
                "0",
                "--store",
                store.url,
                "--allow-path",
                str(media),
            ]
            urls[name] = stack.start(net, h, f"serve-{name}", args, extra_env=mooncake.env(h))
        l = net["l"]
        cmd = [
            str(SGLANG_PYTHON),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--host",
            l.addr,
            "--port",
            "30000",
            *CPU_FLAGS,
            "--language-only",
            "--encoder-transfer-backend",
            "zmq_to_tokenizer",
            "--encoder-bootstrap-port",
            "30001",
            "--encoder-urls",
            urls["e1"],
            urls["e2"],
        ]
        env = sglang_env(**ffmpeg_env(work / "ffmpeg"), SGLANG_HOST_IP=l.addr)
        proc = l.popen(cmd, env=env, log=work / "sglang.log")
        lurl = stack.healthy("SGLang", f"http://{l.addr}:30000", proc, work / "sglang.log", 400)

        def gen(p):
            body = {
                "text": f"hello {IMAGE_TOKEN} what ?",
                "image_data": [p],
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True},
            }
            t = time.monotonic()
            try:
                r = httpx.post(f"{lurl}/generate", json=body, timeout=300)
                return r.status_code, time.monotonic() - t, r.text[:200]
            except httpx.HTTPError as e:
                return 0, time.monotonic() - t, repr(e)[:200]

        out["up"] = [gen(p)[:2] for p in paths[:4]]
        print("up", out["up"], flush=True)
        e2_before = stack.scrape(urls["e2"], "mmferry_requests_total")
        net["e1"].down()
        res = []
        ths = [threading.Thread(target=lambda p=p: res.append(gen(p))) for p in paths[4:16]]
        for t in ths:
            t.start()
            time.sleep(0.5)
        for t in ths:
            t.join(320)
        out["e1_down"] = [r[:2] for r in res]
        out["e2_requests_during"] = stack.scrape(urls["e2"], "mmferry_requests_total") - e2_before
        print("e1_down", json.dumps(out), flush=True)
        net["e1"].up()
    finally:
        net.stop()
        print("left", net.leftovers())
        print(json.dumps(out))


if __name__ == "__main__":
    main()
