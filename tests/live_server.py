"""A live `mqa-serve` process on 127.0.0.1 for the server tests (started as a user would, stopped by
SIGTERM), and the process tree it leaves."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai

from plugins.launch.launcher import free_port

REPO = Path(__file__).resolve().parent.parent
SLOTS = 4


class Server:
    def __init__(self, ckpt, *args, max_waiting=8, graceful_timeout=20):
        # tiny: 2 layers x K,V x 16 dims x 4 bytes x 256 positions x kv heads per token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(ckpt).parent / f"server-{self.port}.log", "w+")
        cmd = [sys.executable, "-m", "plugins.http", str(ckpt), "--dtype", "float32", "--port", str(self.port),
               "--max-waiting", str(max_waiting), "--graceful-timeout", str(graceful_timeout), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx2.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def metric(self, name: str) -> float:
        text = httpx2.get(self.url + "/metrics").text
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
        assert m, f"{name} not in /metrics:\n{text}"
        return float(m.group(1))

    def stop(self, timeout=60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    children = {}
    for line in out:
        if line.strip():
            p, pp = map(int, line.split())
            children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def with_chat_template(ckpt, dst: Path) -> Path:
    """A copy of checkpoint `ckpt` at `dst` whose tokenizer_config.json carries CHAT_TEMPLATE (as
    transformers saves one)."""
    import json
    import shutil

    shutil.copytree(ckpt, dst)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.update(chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>")
    config_file.write_text(json.dumps(config))
    return dst
