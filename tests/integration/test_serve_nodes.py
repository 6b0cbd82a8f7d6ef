"""Tensor parallelism across machines, as two "nodes" on 127.0.0.1: `mqa-serve --nnodes 2 --node-rank R
--rdzv-endpoint` on each (torchrun's c10d rendezvous), one rank per node, HTTP on node 0. Greedy answers
equal `generate` alone token for token (so, equal to TP 2 on one machine, which tests/integration/test_serve.py holds
to the same answers); a rank of node 1 killed is one clear error on both nodes, and nothing is left."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import torch
from live_server import REPO, Server, descendants

from plugins.core.tokenizer import prompt_token_ids
from plugins.launch.launcher import free_port
from plugins.engine.registry import load_backend


def test_tp2_over_two_nodes_answers_as_generate_alone_and_a_dead_rank_stops_both(ckpt, tokenizer):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = ["--tp", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint]
    log = open(Path(ckpt).parent / "node1.log", "w+")
    node1 = subprocess.Popen([sys.executable, "-m", "plugins.http", str(ckpt), "--dtype", "float32", *nodes,
                              "--node-rank", "1"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    server = None
    try:
        server = Server(ckpt, "--backend", "deepspeed", *nodes, "--node-rank", "0")
        prompts = [prompt_token_ids(tokenizer, 4 + 5 * i, i) for i in range(6)]

        def ask(i):
            r = httpx2.post(server.url + "/v1/completions", timeout=120, json={
                "model": Path(ckpt).name, "prompt": prompts[i], "max_tokens": 5 + i, "temperature": 0,
                "ignore_eos": True, "logprobs": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["logprobs"]["tokens"]

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        engine = load_backend("deepspeed", ckpt, dtype="float32")
        for i, tokens in enumerate(answers):
            t = torch.tensor([prompts[i]])
            new = engine.generate(t, torch.ones_like(t), 5 + i).tokens[0, len(prompts[i]):].tolist()
            assert tokens == [tokenizer.decode([x], skip_special_tokens=False) for x in new], i

        commands = {p: Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ") for p in descendants(node1.pid)}
        [rank1] = [p for p, c in commands.items() if "plugins.launch.worker" in c and "torch.distributed.run" not in c]
        front_workers = descendants(server.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert server.proc.wait(60) == 1, server.output()
        assert "the engine failed" in server.output() and "died" in server.output(), server.output()
        assert node1.wait(60) == 1
        log.seek(0)
        text = log.read()
        assert "this node's ranks ended with code" in text
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{p}").exists() for p in front_workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in front_workers if Path(f"/proc/{p}").exists()], "workers left behind"
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        if node1.poll() is None:
            node1.kill()
