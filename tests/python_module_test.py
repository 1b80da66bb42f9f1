"""The Python module as a capacity planner uses it: predict() returns the CLI's JSON as a
dict, bad input raises ValueError with the CLI's message, a sweep finds the largest
batch that fits a budget, and plan() returns the checkpoint planner's answer. Expected numbers come from hand arithmetic in the C++ tests
(model_presets_test, predict_test)."""

import json
import os
import stat
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.environ.get("TEST_SRCDIR", "."), "memledger", "api"))
import memledger  # noqa: E402


def nested(depth):
    """A list nested `depth` levels deep: [[[...]]]."""
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


class PredictTest(unittest.TestCase):
    def test_five_line_example(self):
        p = memledger.predict(model="llama-3-8b", batch=1, seq=8192, amp="bf16")
        self.assertEqual(p["n_params"], 8030261248)
        self.assertEqual(p["amp"], "bf16")
        self.assertEqual(set(p["saved_bytes"]), {"none", "full", "every_2", "selective"})
        self.assertTrue(
            memledger.__version__.startswith("memledger 1 (torch 2.15.0, transformers 5.23.0)"))

    def test_the_tables_head_share_has_its_key(self):
        # tiny-llama's none (predict_test's TinyLlamaByHand): head and loss 798,724 of
        # 5,316,612 saved bytes, 15.02%.
        p = memledger.predict(model="tiny-llama", variants="none")
        self.assertEqual(p["saved_bytes_by_segment"]["none"]["head_loss_share"], 0.1502)

    def test_a_prediction_prints_a_summary_and_shows_its_table_and_chart(self):
        p = memledger.predict(model="tiny-llama", variants="none,full")
        self.assertIsInstance(p, dict)
        self.assertEqual(
            repr(p), "memledger.Prediction(tiny-llama: n_params=24736, saved_bytes="
            f"{p['saved_bytes']}, peak_bytes={p['peak_bytes']})")
        html = p._repr_html_()  # Jupyter's rich display
        self.assertIn("peak of the step", html)
        self.assertIn("<svg", html)
        self.assertEqual(html.count("<svg"), 1)
        # Per rank: the table and the most loaded rank's step, as predict --dp draws it.
        ranks = memledger.predict(model="tiny-llama", dp=2)._repr_html_()
        self.assertIn("<pre>", ranks)
        self.assertEqual(ranks.count("<svg"), 1)
        self.assertIn("the most loaded rank's step, predicted (stage 0", ranks)
        # predict() answers with the JSON: a table or a sweep is a ValueError naming where
        # to get it.
        with self.assertRaisesRegex(ValueError, "^format: these calls return the JSON"):
            memledger.predict(format="table")
        with self.assertRaisesRegex(ValueError, "^sweep: predict\\(\\) makes one prediction"):
            memledger.predict(sweep="batch:1..4")
        # A bad option's message is the CLI's, word for word (predict_cli_test).
        with self.assertRaisesRegex(
                ValueError, "^--cpu_threads must be between 1 and 1024, got 0$"):
            memledger.predict(cpu_threads=0)
        with self.assertRaisesRegex(
                ValueError, "^--budget_gib must be a positive number of GiB below 2\\^33, got -1$"):
            memledger.plan(budget_gib=-1)
        # The C ABI's formats: predict renders json, table and svg (csv and jsonl with a
        # sweep); plan json, table, svg (the plan's step) and frontier_svg.
        import json
        code, text = memledger._call("predict", json.dumps({"format": "xml"}))
        self.assertEqual((code, text), (2, 'request: "format" must be "json", "table" or "svg" '
                                           '("csv" and "jsonl" go with "sweep")'))
        code, text = memledger._call("plan", json.dumps({"budget_gib": 1, "format": "xml"}))
        self.assertEqual((code, text), (2, 'request: "format" must be "json", "table", "svg" '
                                           'or "frontier_svg"'))

    def test_a_mixture_of_experts_and_its_routing(self):
        # tiny-qwen3-moe: 43,488 parameters (model_presets_test's hand count). grouped_mm's
        # sizes are the routing's totals, so --routing changes nothing; the eager experts'
        # saved bytes neither (each expert's rows sum to the same), their peak does (with SGD,
        # whose step keeps nothing, it is the backward's).
        grouped = memledger.predict(model="tiny-qwen3-moe", batch=2, seq=8, variants="none")
        self.assertEqual(grouped["n_params"], 43488)
        self.assertEqual(grouped["config"]["moe"]["routing"], "any")
        balanced, worst = (memledger.predict(model="tiny-qwen3-moe", batch=2, seq=8,
                                             variants="none", experts_impl="eager",
                                             optimizer="sgd", routing=r)
                           for r in ("balanced", "worst"))
        self.assertEqual(worst["config"]["moe"]["routing"], "worst")
        self.assertEqual(balanced["saved_bytes"], worst["saved_bytes"])
        self.assertNotEqual(balanced["peak_bytes"], worst["peak_bytes"])
        with self.assertRaisesRegex(ValueError, "apply to a mixture-of-experts model"):
            memledger.predict(model="tiny-llama", routing="worst")

    def test_on_cuda_the_peaks_are_the_allocators(self):
        # --device=cuda through Python: blocks of 512 B at least (cuda_allocator_test
        # replays the stream through torch's allocator), segments at least as large; the
        # kernel named; a kernel that cannot run the call is a ValueError.
        p = memledger.predict(model="tiny-llama", device="cuda", dtype="bf16", variants="full")
        self.assertEqual((p["device"], p["sdpa_kernel"]), ("cuda", "cudnn"))
        self.assertEqual(p["peak_bytes"]["full"] % 512, 0)
        self.assertGreaterEqual(p["peak_reserved_bytes"]["full"], p["peak_bytes"]["full"])
        # Outside the allocator, its own bucket: the CUDA context, 256 MiB when asked.
        self.assertEqual(memledger.predict(model="tiny-llama", device="cuda", dtype="bf16",
                                           cuda_context_mib=256)["outside_allocator_bytes"],
                         {"cuda_context": 256 << 20})
        many = memledger.predict_many([dict(model="tiny-llama", device="cuda", dtype="bf16",
                                            variants="full")])
        self.assertEqual(many[0]["peak_bytes"], p["peak_bytes"])
        with self.assertRaisesRegex(ValueError, "fp16 or bf16 only"):
            memledger.predict(model="tiny-llama", device="cuda", sdpa_backend="flash")

    def test_default_is_the_study(self):
        self.assertEqual(memledger.predict()["saved_bytes"]["none"], 51052544)

    def test_every_kind_of_bad_input_raises_value_error(self):
        cases = [
            (dict(layers=0), "--layers must be >= 1, got 0"),
            (dict(width=130), "--width 130 is not divisible by --heads 4"),
            (dict(model="llama-9"), "--model: 'llama-9' is neither a built-in model"),
            (dict(variants="none,fast"), "--variants: unknown variant 'fast'"),
            (dict(policy="softmax"), "--policy: unknown op kind 'softmax'"),
            (dict(amp="bf16", dtype="bf16"), "--amp=bf16 needs --dtype=fp32"),
            (dict(layer=2), '"layer" is not a request key'),
            (dict(layers="2"), '"layers" must be an integer'),
            (dict(master_weights=1), '"master_weights" must be true or false'),
            (dict(batch=2**40, seq=2**30), "overflow"),
            # A NaN in a config dict was "request: not JSON (Invalid value. at offset 49)".
            (dict(model={"model_type": "llama", "rope_theta": float("nan")}),
             "model.rope_theta: nan is not a number JSON can say"),
            (dict(batch=float("inf")), "batch: inf is not a number JSON can say"),
            # Nested past the C ABI's limit: refused before parsing.
            (dict(model={"model_type": "llama", "x": nested(70)}),
             "nests arrays and objects deeper than 64 levels"),
        ]
        for fields, message in cases:
            with self.subTest(fields=fields):
                with self.assertRaises(ValueError) as raised:
                    memledger.predict(**fields)
                self.assertIn(message, str(raised.exception))

    def test_sweep_finds_the_largest_batch_that_fits(self):
        # llama-3-8b, bf16 with fp32 master weights and AdamW, full checkpointing: the
        # fixed part is 2 + 2 + 12 bytes per parameter; activations grow with the batch.
        budget = 160 * 2**30
        best = {}
        for seq in (1024, 2048, 4096, 8192):
            for batch in (1, 2, 4, 8, 16, 32, 64):
                p = memledger.predict(model="llama-3-8b", batch=batch, seq=seq, dtype="bf16",
                                      master_weights=True, variants="full")
                total = (p["param_bytes"] + p["grad_bytes"] + p["optimizer_state_bytes"] +
                         p["saved_bytes"]["full"])
                if total <= budget:
                    best[seq] = batch
        # The largest batch shrinks as sequences grow, and something fits at 1024.
        self.assertIn(1024, best)
        fitting = [best.get(seq, 0) for seq in (1024, 2048, 4096, 8192)]
        self.assertEqual(fitting, sorted(fitting, reverse=True))
        self.assertGreater(fitting[0], fitting[-1])

    def test_the_most_loaded_gpu_of_a_512_gpu_run(self):
        # llama-3-70b, TP 8 x PP 4 x DP 16, ZeRO-1. By hand, one tensor-parallel rank's
        # layer holds q 8192 x 1024 + k, v 8192 x 128 + o 1024 x 8192 + gate, up, down
        # 3 x 8192 x 3584 + two norms 2 x 8192 = 106,971,136 parameters; stage 0 has 20
        # layers and the embedding's 128,256 / 8 x 8192 rows: 2,270,756,864. AdamW's
        # fp32 moments over ZeRO-1's ceil(n / 16) = 141,922,304: 1,135,378,432 B, and
        # the flat shard's one 4-byte step tensor.
        p = memledger.predict(model="llama-3-70b", tp=8, pp=4, dp=16, zero=1, amp="bf16",
                              batch=1, seq=8192, micro_batches=8, variants="none,full")
        self.assertEqual(p["parallel"]["world_size"], 512)
        self.assertEqual([r["ranks"] for r in p["ranks"]], [128] * 4)
        first = p["ranks"][0]
        self.assertEqual(first["stage"], 0)
        self.assertEqual(first["n_params"], 2270756864)
        self.assertEqual(first["optimizer_state_bytes"], 1135378432 + 4)
        self.assertEqual(first["micro_batches_in_flight"], {"none": 4, "full": 4})
        self.assertEqual(p["saved_bytes"], first["saved_bytes"])




class PlanTest(unittest.TestCase):
    def test_plan_fits_the_budget_and_beats_full(self):
        # The study's default: full checkpointing peaks at 29,551,848 B (measured by the
        # counting allocator, runtime_test, and by the real stack's profiler on the
        # unchanged study, verify/witness.py; AdamW's 72 step tensors of 4 B and the
        # peaking layer's 5,056-byte RNG state included); a 40 MiB budget lets the
        # planner keep more.
        p = memledger.plan(budget_gib=40 / 1024, frontier_points=0)
        self.assertEqual(len(p["plan"]), 6)
        self.assertLessEqual(p["peak_bytes"], 40 * 2**20)
        self.assertEqual(p["variants"]["full"]["peak_bytes"], 29551848)
        self.assertLess(p["overhead"], p["variants"]["full"]["overhead"])

    def test_a_config_is_a_name_a_path_a_dict_or_a_pretrained_config(self):
        import json
        import pathlib
        import tempfile

        config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                  "vocab_size": 128, "n_positions": 256, "use_cache": False,
                  "architectures": ["GPT2LMHeadModel"]}  # keys memledger ignores too
        path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
        path.write_text(json.dumps(config))
        by_path = memledger.predict(model=str(path), variants="none,full")

        class PretrainedConfigLike:  # transformers' duck type: to_dict()
            def to_dict(self):
                return dict(config)

        for model in (config, path, PretrainedConfigLike()):
            p = memledger.predict(model=model, variants="none,full")
            self.assertEqual(p["saved_bytes"], by_path["saved_bytes"])
            self.assertEqual(p["peak_bytes"], by_path["peak_bytes"])
        many = memledger.predict_many([dict(model=PretrainedConfigLike(), variants="full")])
        self.assertEqual(many[0]["saved_bytes"]["full"], by_path["saved_bytes"]["full"])
        with self.assertRaises(ValueError) as raised:
            memledger.predict(model={"model_type": "gpt2"})
        self.assertIn('request: "model": "n_embd" is missing', str(raised.exception))

    def test_predict_many_is_predict_in_one_call(self):
        requests = [dict(batch=b, seq=s) for b in (1, 2, 8) for s in (16, 64)]
        requests.append(dict(model="tiny-llama", amp="bf16", variants="none,full"))
        for peak in (True, False):
            many = memledger.predict_many(requests, peak=peak)
            self.assertEqual(len(many), len(requests))
            for request, result in zip(requests, many):
                p = memledger.predict(**request)
                self.assertEqual(result["saved_bytes"], p["saved_bytes"])
                self.assertEqual(result["param_bytes"], p["param_bytes"])
                self.assertEqual(result["optimizer_state_bytes"], p["optimizer_state_bytes"])
                if peak:
                    self.assertEqual(result["peak_bytes"], p["peak_bytes"])
                else:
                    self.assertNotIn("peak_bytes", result)
        self.assertEqual(memledger.predict_many([], peak=False), [])
        with self.assertRaises(ValueError) as raised:
            memledger.predict_many([dict(batch=2), dict(seq=0)], peak=False)
        self.assertEqual(str(raised.exception), "requests[1]: --seq must be >= 1, got 0")
        # The requests reach C++ as values, not a JSON text, with JSON's types checked
        # as the JSON reader checks them.
        with self.assertRaisesRegex(ValueError, "^requests\\[1\\]: request: \"batch\" must be an integer"):
            memledger.predict_many([dict(batch=2), dict(batch=2.0)], peak=False)
        with self.assertRaisesRegex(ValueError, "^requests\\[1\\]: request: not a JSON object"):
            memledger.predict_many([dict(batch=2), "batch=2"], peak=False)
        with self.assertRaisesRegex(ValueError, "nan is not a number JSON can say"):
            memledger.predict_many([dict(momentum=float("nan"))], peak=False)
        circular = []
        circular.append(circular)
        with self.assertRaisesRegex(ValueError, "a circular reference"):
            memledger.predict_many([dict(model=dict(layer_types=circular))], peak=False)
        with self.assertRaises(ValueError):
            memledger.predict_many([dict(dp=2)])
        with self.assertRaises(ValueError):
            memledger.predict_many([dict(batch=2)], threads=-1)

    def test_snapshot_replays_to_the_predicted_peak(self):
        import pickle
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "full.pickle")
        data = memledger.snapshot(model="tiny-llama", variant="full", path=path)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), data)
        snapshot = pickle.loads(data)
        live = peak = 0
        for e in snapshot["device_traces"][0]:
            live += e["size"] if e["action"] == "alloc" else 0
            live -= e["size"] if e["action"] == "free_completed" else 0
            peak = max(peak, live)
        p = memledger.predict(model="tiny-llama", variants="full")
        self.assertEqual(peak, p["peak_bytes"]["full"])
        with self.assertRaises(ValueError):
            memledger.snapshot(model="tiny-llama")  # four variants
        with self.assertRaises(ValueError):
            memledger.snapshot(variant="full", seq=0)
        # A file descriptor is no path (open(1, "wb") wrote to stdout and closed it).
        with self.assertRaises(TypeError) as raised:
            memledger.snapshot(model="tiny-llama", variant="full", path=1)
        self.assertIn("path must be a str or an os.PathLike, not int", str(raised.exception))
        # The command line's writer: a FIFO is refused and stays one.
        fifo = os.path.join(os.path.dirname(path), "fifo")
        os.mkfifo(fifo)
        with self.assertRaises(ValueError) as raised:
            memledger.snapshot(model="tiny-llama", variant="full", path=fifo)
        self.assertIn("is a FIFO, not a regular file", str(raised.exception))
        self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode))

    def test_plan_one_data_parallel_rank(self):
        # One of 2 ZeRO-1 ranks: its optimizer state is half the model's (AdamW's moments
        # of a 1 / dp shard, one step tensor), and the plan fits the budget per rank.
        p = memledger.plan(model="tiny-llama", dp=2, zero=1, budget_gib=1, frontier_points=0)
        self.assertEqual(p["parallel"]["dp"], 2)
        self.assertEqual(p["parallel"]["zero"], 1)
        whole = memledger.predict(model="tiny-llama", variants="none")
        self.assertLess(p["optimizer_state_bytes"], whole["optimizer_state_bytes"])
        self.assertLessEqual(p["peak_bytes"], 2**30)

    def test_plan_on_cuda_fits_the_device(self):
        # On cuda the budget holds the replayed reserved peak and the CUDA context.
        p = memledger.plan(model="tiny-llama", device="cuda", dtype="bf16", batch=8,
                           seq=1024, budget_gib=0.38, frontier_points=0)
        self.assertLessEqual(p["device_bytes"], p["budget_bytes"])
        self.assertEqual(p["device_bytes"], p["peak_reserved_bytes"] +
                         p["outside_allocator_bytes"]["cuda_context"])
        with self.assertRaises(memledger.NoPlanFits):
            memledger.plan(model="tiny-llama", device="cuda", budget_gib=0.25)

    def test_no_plan_fits_raises_no_plan_fits(self):
        with self.assertRaises(memledger.NoPlanFits) as raised:
            memledger.plan(budget_gib=0.01)
        self.assertIn("the smallest peak any plan reaches is", str(raised.exception))
        self.assertTrue(issubclass(memledger.NoPlanFits, ValueError))
        with self.assertRaises(ValueError):
            memledger.plan(layers=3)  # no budget


class SearchTest(unittest.TestCase):
    def test_search_returns_layouts_and_raises_no_layout_fits(self):
        r = memledger.search(model="tiny-llama", layers=4, seq=8, gpus=4, gpus_per_node=4,
                             global_batch=4, gpu_memory_gib=1)
        self.assertGreater(len(r["layouts"]), 0)
        best = r["layouts"][0]
        self.assertEqual(best["tp"] * best["pp"] * best["dp"], 4)
        self.assertEqual(best["micro_batch_size"] * best["micro_batches"] * best["dp"], 4)
        times = [l["step_time_s"] for l in r["layouts"]]
        self.assertEqual(times, sorted(times))
        # No precision key: the search's default, said and carried by the flags.
        self.assertEqual(r["search"]["default_precision"], "bf16 parameters, fp32 master weights")
        self.assertIn("--dtype=bf16 --master_weights", best["flags"])
        named = memledger.search(model="tiny-llama", layers=4, seq=8, gpus=4, gpus_per_node=4,
                                 global_batch=4, gpu_memory_gib=1, dtype="fp32")
        self.assertNotIn("default_precision", named["search"])
        with self.assertRaises(memledger.NoLayoutFits) as raised:
            memledger.search(model="tiny-llama", gpus=2, global_batch=2, gpu_memory_gib=1e-6)
        self.assertIn("the smallest peak of any layout is", str(raised.exception))
        self.assertTrue(issubclass(memledger.NoLayoutFits, ValueError))
        with self.assertRaises(ValueError):
            memledger.search(model="tiny-llama", gpus=2)  # no global batch
        with self.assertRaises(ValueError):
            memledger.search(model="tiny-llama", gpus=2, global_batch=2, micro_batches=2)
        fixed = memledger.search(model="tiny-llama", gpus=2, global_batch=2, tp=2)
        self.assertTrue(all(l["tp"] == 2 for l in fixed["layouts"]))


API_DIR = os.path.join(os.environ.get("TEST_SRCDIR", "."), "memledger", "api")


def command(args, cwd, stdout=subprocess.PIPE, umask=None):
    """The `memledger` command (api/memledger_cli.py) run with `args`: (exit, out, err)."""
    env = dict(os.environ, PYTHONPATH=API_DIR)
    preexec = (lambda: os.umask(umask)) if umask is not None else None
    run = subprocess.run([sys.executable, os.path.join(API_DIR, "memledger_cli.py")] + args,
                         cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE,
                         preexec_fn=preexec)
    return run.returncode, run.stdout, run.stderr.decode("utf-8", "replace")


class CommandTest(unittest.TestCase):
    """The `memledger` command's bad input, as the Bazel CLIs': one line, exit 2, no file
    lost or half-written."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

    def refused(self, args, message):
        code, _, err = command(args, self.dir)
        self.assertEqual(code, 2, err)
        self.assertIn(message, err)
        self.assertEqual(err.count("\n"), 1, err)
        return err

    def test_an_output_that_is_another_output_or_an_input_is_refused(self):
        self.refused(["predict", "--model=tiny-llama", "--json_out=a.json",
                      "--timeline_svg=./a.json"],
                     "--timeline_svg=./a.json: is the same file as --json_out=a.json")
        self.refused(["plan", "--model=tiny-llama", "--budget_gib=0.01", "--plan_out=p.json",
                      "--frontier_svg=p.json"],
                     "--frontier_svg=p.json: is the same file as --plan_out=p.json")
        config = os.path.join(self.dir, "config.json")
        with open(config, "w") as f:
            f.write('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                    '"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}')
        self.refused(["predict", "--model=config.json", "--json_out=" + config],
                     f"--json_out={config}: is the same file as --model=config.json, which "
                     "the run reads")
        with open(config) as f:
            self.assertIn("model_type", f.read())
        self.assertEqual(sorted(os.listdir(self.dir)), ["config.json"])

    def test_a_file_keeps_the_mode_a_shell_gives_it(self):
        secret = os.path.join(self.dir, "secret.json")
        with open(secret, "w") as f:
            f.write("old")
        os.chmod(secret, 0o600)
        code, _, err = command(["predict", "--model=tiny-llama", "--json_out=secret.json"],
                               self.dir)
        self.assertEqual(code, 0, err)
        self.assertEqual(stat.S_IMODE(os.stat(secret).st_mode), 0o600)
        code, _, err = command(["predict", "--model=tiny-llama", "--json_out=new.json"],
                               self.dir, umask=0o027)
        self.assertEqual(code, 0, err)
        self.assertEqual(stat.S_IMODE(os.stat(os.path.join(self.dir, "new.json")).st_mode),
                         0o640)

    def test_a_name_of_255_bytes_is_written(self):
        name = "n" * 250 + ".json"
        code, out, err = command(["predict", "--model=tiny-llama", "--json_out=" + name],
                                 self.dir)
        self.assertEqual(code, 0, err)
        with open(os.path.join(self.dir, name), "rb") as f:
            self.assertEqual(f.read(), out)
        self.refused(["predict", "--model=tiny-llama", "--json_out=x" + name],
                     "File name too long")
        self.assertEqual(os.listdir(self.dir), [name])

    def test_a_closed_pipe_writes_no_file(self):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the command writes
        try:
            code, _, err = command(["predict", "--model=tiny-llama", "--json_out=a.json",
                                    "--timeline_svg=a.svg"], self.dir, stdout=write)
        finally:
            os.close(write)
        self.assertEqual(code, 2, err)
        self.assertEqual(err, "error: cannot write to standard output: Broken pipe\n")
        self.assertEqual(os.listdir(self.dir), [])

    def test_help_on_a_full_disk_is_an_error(self):
        if not os.path.exists("/dev/full"):
            self.skipTest("no /dev/full")
        for args in (["--help"], ["predict", "--help"]):
            with open("/dev/full", "wb") as full:
                code, _, err = command(args, self.dir, stdout=full)
            self.assertEqual(code, 2, args)
            self.assertEqual(err, "error: cannot write to standard output: No space left on "
                             "device\n", args)

    def test_control_characters_are_written_out(self):
        err = self.refused(["predict", "--model=bad\nname\x1b[31m caf\u00e9"],
                           "bad\\nname\\x1b[31m caf\u00e9")
        self.assertNotIn("\x1b", err)
        # An undecodable byte of argv cannot reach the library's JSON: refused, shown as
        # \xff.
        self.refused(["predict", os.fsdecode(b"--model=a\xff")], "--model=a\\xff: not valid UTF-8")
        self.refused(["predict", "--model=tiny-llama", "--json_out=/nonexistent/\r.json"],
                     "--json_out=/nonexistent/\\r.json: cannot create a temporary file")

    def test_data_parallel_flags_reach_the_prediction(self):
        # The Bazel CLI's DDP and FSDP2 flags (they were unknown to this command).
        code, out, err = command(
            ["predict", "--model=tiny-llama", "--batch=2", "--seq=32", "--dp=2", "--fsdp",
             "--reshard_after_forward=false", "--mp_param_dtype=bf16",
             "--mp_reduce_dtype=fp32", "--device=cuda", "--offload=cpu", "--variants=none"],
            self.dir)
        self.assertEqual(code, 0, err)
        parallel = json.loads(out)["parallel"]
        self.assertEqual(parallel["data_parallel"], "fsdp2")
        self.assertEqual(parallel["fsdp"]["reshard_after_forward"], False)
        code, out, err = command(
            ["predict", "--model=tiny-llama", "--dp=2", "--ddp_bucket_mb=0.1",
             "--gradient_as_bucket_view", "--variants=none"], self.dir)
        self.assertEqual(code, 0, err)
        code, out, _ = command(["predict", "--help"], self.dir)
        for flag in ("--fsdp", "--offload", "--reshard_after_forward", "--mp_param_dtype",
                     "--ddp_bucket_mb", "--gradient_as_bucket_view"):
            self.assertIn(flag, out.decode())

    def test_offloaded_activations_reach_the_prediction(self):
        # tiny-llama, batch 4, seq 128, full checkpointing under save_on_cpu: 811,140 B of
        # host copies when the forward returns (by hand in predict_test's
        # OffloadedActivationsByHand).
        code, out, err = command(
            ["predict", "--model=tiny-llama", "--batch=4", "--seq=128", "--device=cuda",
             "--offload_activations=cpu", "--variants=full"], self.dir)
        self.assertEqual(code, 0, err)
        prediction = json.loads(out)
        self.assertEqual(prediction["offload_activations"], "cpu")
        self.assertEqual(prediction["offloaded_bytes"], {"full": 811140})
        self.refused(["predict", "--model=tiny-llama", "--offload_activations=cpu"],
                     "--offload_activations=cpu copies what autograd saves from a GPU to host "
                     "memory: it needs --device=cuda")
        code, out, _ = command(["predict", "--help"], self.dir)
        self.assertIn("--offload_activations", out.decode())

    def test_bad_numbers_name_their_flag(self):
        self.refused(["plan", "--model=tiny-llama", "--budget_gib=1e-12"],
                     "--budget_gib 1e-12 is less than one byte")
        self.refused(["predict", "--model=tiny-llama", "--cuda_context_mib=100"],
                     "--cuda_context_mib is the CUDA context's device memory: it needs "
                     "--device=cuda")


if __name__ == "__main__":
    unittest.main()
