"""lm-evaluation-harness itself (`make clients`) against the server: a local multiple-choice
(loglikelihood) task and a generate_until task, written here, run with lm-eval's `local-completions`
model on our server and with lm-eval's `hf` model on the same checkpoint directory, fp32: the same
log-likelihood per request (1e-4), the same accuracy, the same generations."""

import json
import os

import pytest
from live_server import Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded here: datasets and the hub stay local
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is installed by `make clients`")

MC = [{"question": "x = [1, 2, 3]\nlen(x) ==", "choices": [" 3", " 2", " 1", " 0"], "label": 0},
      {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "label": 0},
      {"question": "import", "choices": [" os", " sys", " re"], "label": 1},
      {"question": "for i in range(10):\n   ", "choices": [" print(i)", " pass", " break", " continue"], "label": 0}]
GEN = [{"question": "class Stack:\n    def push(self, item):\n", "answer": "        self.items.append(item)"},
       {"question": "def fib(n):\n", "answer": "    if n < 2:"}]


def write_tasks(root):
    data = root / "data"
    data.mkdir()
    for name, rows in (("mc", MC), ("gen", GEN)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "mqa_mc.yaml").write_text(f"""task: mqa_mc
dataset_path: json
dataset_kwargs:
  data_files: {data / 'mc.jsonl'}
output_type: multiple_choice
test_split: train
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (root / "mqa_gen.yaml").write_text(f"""task: mqa_gen
dataset_path: json
dataset_kwargs:
  data_files: {data / 'gen.jsonl'}
output_type: generate_until
test_split: train
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["@@@"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return root


def evaluate(model, model_args, include):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["mqa_mc", "mqa_gen"],
                                   task_manager=TaskManager(include_path=str(include)), log_samples=True,
                                   batch_size=1, device="cpu", random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def responses(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_local_completions_on_our_server_equals_lm_evals_hf_model(ckpt, tmp_path):
    include = write_tasks(tmp_path)
    server = Server(ckpt, "--backend", "hf")
    try:
        ours = evaluate("local-completions", f"model={ckpt.name},base_url={server.url}/v1/completions,"
                        "tokenizer_backend=remote,num_concurrent=1,max_retries=1", include)
    finally:
        server.stop()
    hf = evaluate("hf", f"pretrained={ckpt},dtype=float32", include)
    for ours_doc, hf_doc in zip(responses(ours, "mqa_mc"), responses(hf, "mqa_mc")):
        assert len(ours_doc) == len(hf_doc)
        for (ours_ll, ours_greedy), (hf_ll, hf_greedy) in zip((r[0] for r in ours_doc), (r[0] for r in hf_doc)):
            assert abs(float(ours_ll) - float(hf_ll)) < 1e-4
            assert bool(ours_greedy) == bool(hf_greedy)
    assert ours["results"]["mqa_mc"]["acc,none"] == hf["results"]["mqa_mc"]["acc,none"]
    assert responses(ours, "mqa_gen") == responses(hf, "mqa_gen")
    assert all(r[0][0].strip() for r in responses(ours, "mqa_gen"))  # real text (the seeded model's), not empty
    assert len(responses(ours, "mqa_mc")) == len(MC) and len(responses(ours, "mqa_gen")) == len(GEN)
