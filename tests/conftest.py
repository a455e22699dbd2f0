"""Test set-up: 8 simulated CPU devices, requested before any JAX operation."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# ------------------------------------------------------- XLA:CPU compiles fast, not programs
# XLA:CPU's code generation takes most of the suite's time (the tests' programs are tiny and
# run a few steps): LLVM at -O0 with the loop emitters instead of the fusion emitters compiles
# a decoder's train step about 4x faster (a test in test_decoder.py: 27.5 s -> 4.2 s of
# compiles on jax 0.10.2; make test 20:58 -> 11:31 on 2 cores). The HLO passes, hence the
# sharding and the collectives the tests read, are XLA's own either way, and every tolerance
# holds on jax 0.10.2; the TPU and GPU compilers' programs are unchanged (same HLO, same
# memory). Set in the environment, so the processes the tests start compile the same way.
# The pair or nothing: an XLA that does not know a flag aborts, so they are tried first, and
# jaxlib 0.12 has no fusion-emitters switch; there -O0 alone moved a float32 equality test
# past its tolerance (test_gather_layers_trains_the_scanned_decoder_as_on_one_device: 7e-5
# relative, against 3e-5), so make test-latest compiles as XLA does by default.
# DTENSOR_TEST_XLA_DEFAULTS=1 runs the suite on XLA's default CPU code generation.
_FAST_CPU = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _known(flags: list[str]) -> bool:
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = "import jax; jax.jit(lambda x: x + 1)(1)"
    return (
        subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0
    )


if not os.environ.get("DTENSOR_TEST_XLA_DEFAULTS"):
    _given = os.environ.get("XLA_FLAGS", "")
    _add = [f for f in _FAST_CPU if f.split("=")[0] not in _given]
    if _add and _known([*_add, _given]):
        os.environ["XLA_FLAGS"] = " ".join([*_add, _given]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# ------------------------------------------- one compilation cache for the run's processes
# The processes the tests start (the demo, dtensor.launch workers, notebooks' kernels) compile
# the same CPU programs again and again: JAX's persistent compilation cache, one directory per
# run, shared by the xdist workers' children (a process reads it from the environment when it
# imports jax). In the test processes themselves only for CPU compiles: their TPU/GPU compiles
# for libtpu/XLA:GPU topologies cannot be read back from the cache without a device client (JAX
# warns and compiles again), so whether a test warned would depend on which test compiled the
# same program first.
# Removed at exit by whoever made it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="dtensor-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


def _cpu_compiles_only() -> None:
    """This process's CPU compiles share the run's cache too; its TPU and GPU compiles do not.

    Many tests compile the same CPU programs (a single-device reference step, a preset's
    step of the same model) in different modules and xdist workers. JAX decides whether
    to use the cache once per process, not per backend: the check is wrapped so that only
    the CPU client's compiles read and write it (none where this JAX lacks the hook).
    """
    try:
        from jax._src import compilation_cache
    except ImportError:
        jax.config.update("jax_compilation_cache_dir", None)
        return
    used = getattr(compilation_cache, "is_cache_used", None)
    if used is None or getattr(used, "_dtensor_cpu_only", False):
        return

    def is_cache_used(backend) -> bool:
        return getattr(backend, "platform", None) == "cpu" and used(backend)

    is_cache_used._dtensor_cpu_only = True  # type: ignore[attr-defined]
    compilation_cache.is_cache_used = is_cache_used
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


_cpu_compiles_only()

# ------------------------------------------------------------ the collector, for tracing's objects
# Tracing, lowering and NNX's graph walks make millions of short-lived objects, and at CPython's
# default thresholds (700, 10, 10) the collector ran thousands of times a module, its full
# passes walking every object jax, flax and the tests ever imported: 8.6 s of 116 s of
# test_decoder.py + test_gradient_scale.py in one process (timed with gc.callbacks), 3.4 s with
# these thresholds and what collection imported frozen out of the passes (pytest_collection_finish
# below). Nothing here relies on when the collector runs: the tests that need garbage gone call
# gc.collect() themselves.
gc.set_threshold(10_000, 10, 10)

# Scripts that tests start as real processes are not test modules (and set up JAX
# their own way at import): keep them out of collection, doctests included.
collect_ignore_glob = ["workers_ckpt/*", "multiprocess/workers/*", "gcs_server.py"]


# ------------------------------------------------------------ a GCS API on loopback
import pytest  # noqa: E402

from tests.gcs import Emulator, emulator, fresh_url  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory):
    """One ``gcp-storage-emulator`` per test process (per xdist worker), stopped by PID at the end."""
    with emulator(tmp_path_factory.mktemp("gcs") / "data") as em:
        yield em


@pytest.fixture
def gcs(gcs_emulator: Emulator, monkeypatch: pytest.MonkeyPatch, tmp_path, request):
    """A fresh ``gs://`` URL; the emulator's variables set for this test only; no local ``gs:``.

    The test runs in an empty working directory, and fails when anything was
    written under a local ``gs:`` directory (a URL taken for a path).
    """
    for key, value in gcs_emulator.env.items():
        monkeypatch.setenv(key, value)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    yield fresh_url(request.node.name)
    assert not (work / "gs:").exists(), "a gs:// URL was written to local disk as ./gs:"


# ------------------------------------------------------- what `make test` leaves to CI
# `make test` (the README's command) runs everything but these; `make test-extended` runs
# them, and .ci/run runs both. Each repeats what a test in `make test` already checks at
# another size, topology or repetition count, or spends minutes of processes on one path;
# none is skipped anywhere (CI's run of .ci/run is where they run). A node id here names a
# test function (all its parameters) or one parameter of it; one that no longer names a
# collected test fails the collection, so a rename cannot drop a test from both commands.
EXTENDED = {
    # every preset on the GPU topologies (one host, two hosts, two slices); make test keeps the
    # GPU compiles of Mirrored, FSDP and data parallelism across hosts (tests/test_gpu.py)
    "tests/test_gpu.py::test_every_preset_compiles_for_gpu[h100:1x8]": "topology",
    "tests/test_gpu.py::test_every_preset_compiles_for_gpu[h100:2x8]": "topology",
    "tests/test_gpu.py::test_every_preset_compiles_for_gpu[h100:2x2x8]": "topology",
    # the TPU presets on one topology in make test (v5e:4x4, one slice)
    "tests/test_tpu.py::test_every_preset_compiles_for_tpu[v5e:4x4-2]": "topology",
    "tests/test_tpu.py::test_every_preset_compiles_for_tpu[v4:2x2x2-1]": "topology",
    "tests/test_tpu.py::test_every_preset_compiles_for_tpu[tpu7x:2x2x2-1]": "topology",
    # the decoder's block kinds x unrolled/scanned: one of each pairing stays
    "tests/test_decoder.py::test_gemma3_and_llama_blocks_train_under_fully_sharded_as_on_one_device"
    "[tiny-gemma3-True]": "variant",
    "tests/test_decoder.py::test_gemma3_and_llama_blocks_train_under_fully_sharded_as_on_one_device"
    "[tiny-llama-False]": "variant",
    "tests/test_decoder.py::test_blocks_train_under_hybrid_tensor_parallel_as_on_one_device"
    "[tiny-gemma3-False]": "variant",
    "tests/test_decoder.py::test_blocks_train_under_hybrid_tensor_parallel_as_on_one_device"
    "[tiny-llama-True]": "variant",
    "tests/test_decoder.py::test_tiny_decoder_trains_under_fully_sharded_as_on_one_device[plain]": (
        "variant"  # the unrolled tiny-gemma3 run under FullyShardedStrategy above covers it
    ),
    "tests/test_decoder.py::test_preset_mixed_precision_and_remat_compute_in_bf16_like_the_bf16"
    "_decoder[False]": "variant",
    # minutes of compiles or processes on one path
    "tests/multiprocess/test_example_presets.py::test_every_preset_runs_the_example_to_its_end"
    "_on_2_processes": "minutes",
    "tests/multiprocess/test_example_presets.py::test_fine_tuning_from_a_hugging_face_checkpoint"
    "_on_2_processes": "minutes",
    "tests/multiprocess/test_example_presets.py::test_stages_spanning_the_processes_read_one"
    "_share_and_train_as_one_process[gpipe]": "variant",
    "tests/multiprocess/test_example_presets.py::test_stages_spanning_the_processes_read_one"
    "_share_and_train_as_one_process[1f1b]": "minutes",
    "tests/multiprocess/test_safetensors_multiprocess.py::test_train_py_exports_a_hugging_face"
    "_folder_from_two_processes": "minutes",
    # the single-device presets across processes (one device each); fully_sharded stays
    "tests/multiprocess/test_strategies_multiprocess.py::test_preset_across_processes_matches"
    "_single_process[one_device-per_process-2-2]": "variant",
    "tests/multiprocess/test_strategies_multiprocess.py::test_preset_across_processes_matches"
    "_single_process[central_storage-global-2-2]": "variant",
    # per-tensor remat plans: one list and one scanned plan stay in make test
    **{
        "tests/strategies/test_remat_policy.py::test_every_plan_trains_the_decoder_as_on_one"
        f"_device[{scan}-{policy}]": "variant"
        for scan, policy in [
            ("False", "qkv_proj_offloaded"),
            ("False", "minimal_offloaded"),
            ("False", "save_dot_except_mlp"),
            ("True", "minimal_offloaded"),
            ("True", "save_dot_except_mlp"),
            ("True", "decoder_layer_input=offload,query_proj=device,mlpwo=remat"),
        ]
    },
    "tests/strategies/test_remat_policy.py::test_the_tpu_program_offloads_exactly_the_tensors"
    "_the_plan_names[False]": "variant",
    "tests/test_fit.py::test_fit_finds_the_cheapest_fitting_options_and_caches_them": "minutes",
    "tests/strategies/test_step_cache.py::test_300_runs_with_fresh_lambdas_keep_memory_bounded"
    "_and_warn_once": "repetitions",
    "tests/multiprocess/test_grain_resume.py::test_two_processes_in_a_bucket_resume_exactly_and_on"
    "_one_and_four": "minutes",
    "tests/multiprocess/test_peer_race.py::test_killed_non_coordinator_never_hangs_a_survivor_under"
    "_load": "repetitions",
    "tests/multiprocess/test_hosts.py::test_preemption_across_hosts_saves_one_step_to_a_bucket_and"
    "_resumes": "minutes",
    "tests/multiprocess/test_parameter_server.py::test_tutorial_across_processes_reaches_the_single"
    "_process_loss": "minutes",
    "tests/test_docs_commands.py::test_launch_without_devices_per_process_gives_2_processes_x_4"
    "_devices": "minutes",
    "tests/test_benchmarks.py::test_fsdp_scale_rows_on_cpu": "minutes",
    # two Gemma 2B-sized compiles (a minute on 2 cores); the cast's values stay in make test
    "tests/strategies/test_cast.py::test_scanned_layers_are_cast_inside_the_loop_on_tpu": "minutes",
    # 30 s of a launcher waiting out its timeout (the peer-loss paths stay in make test)
    "tests/multiprocess/test_peers.py::test_launcher_timeout_stops_joined_processes_with_their"
    "_own_line": "minutes",
    "tests/test_benchmarks.py::test_benchmarks_write_json_and_a_plot": "minutes",
    "tests/test_notebooks.py::test_notebook_runs[02_strategies]": "minutes",
    "tests/test_notebooks.py::test_notebook_runs[03_checkpoint_preemption]": "minutes",
    "tests/test_demo.py::test_demo_json_is_the_only_stdout_and_its_options_apply_1f1b_stages_train_as_mirrored": "variant",
    # HybridStrategy's casts: the plain hybrid run stays (tests/strategies/test_hybrid_gather.py
    # covers its gather-at-read plan)
    "tests/strategies/test_fsdp_options.py::test_mixed_precision_matches_single_device_with_the"
    "_same_casts[hybrid_gather]": "variant",
    # Flax's Gemma: the gather plan's remat=(Block,) run stays in make test (XLA's plan's two
    # runs are in make test-extended; the remat one is moved below)
    "tests/test_flax_gemma.py::test_flax_gemma_trains_under_fully_sharded_as_on_one_device"
    "[xla]": "variant",
    "tests/test_demo.py::test_demo_quiet_under_the_launcher": "variant",
    # MoE: expert=4 (a list of blocks) and data x fsdp x expert = 2 x 2 x 2 scanned (with remat)
    # stay in make test
    "tests/test_experts.py::test_moe_decoder_trains_under_hybrid_expert_as_on_one_device"
    "[data2-fsdp2-expert2]": "variant",
    "tests/test_experts.py::test_moe_decoder_trains_under_hybrid_expert_as_on_one_device"
    "[fsdp2-expert4-scan-remat]": "variant",
    # scanned layers batch-split without remat: the fully sharded program stays in make test
    "tests/test_decoder.py::test_scanned_layers_keep_the_batch_split_without_remat_on_a_tpu"
    "_topology[hybrid]": "variant",
    "tests/test_decoder.py::test_scanned_layers_without_remat_train_under_xla_plan_as_on_one"
    "_device": "variant",
}
# Context attention: the two meshes (context=4; context=2 x fsdp=2 x tensor=2) stay in
# make test, data=2 x fsdp=2 x context=2 runs in make test-extended.
EXTENDED.update(
    {
        "tests/test_context.py::test_context_attention_under_a_context_axis_matches_one_device"
        f"[data2-fsdp2-context2-{kind}-{mode}]": "variant"
        for kind in ("causal", "full", "mask", "causal-mask", "causal-window")
        for mode in ("gather", "ring", "ulysses")
    }
)
# Ulysses on the decoder and Flax's attention: make test keeps the scanned decoder under
# fsdp x tensor x context (KV heads repeated) and Flax's causal masked attention.
EXTENDED.update(
    {
        "tests/test_context.py::test_decoder_trains_under_hybrid_context_as_on_one_device"
        "[context4-data2-ulysses]": "variant",
        "tests/test_context.py::test_flax_attention_trains_under_hybrid_context_unchanged"
        "[mha-full-ulysses]": "variant",
        "tests/test_context.py::test_flax_attention_trains_under_hybrid_context_unchanged"
        "[dot_product_attention-is_causal-ulysses]": "variant",
    }
)

# Pipelines: make test keeps the scanned decoder (stage=4 x data=2, circular: the schedule on a
# stacked scan through the preset), the list of blocks composed with fsdp and tensor
# (circular), Flax's list model (GPipe) and two engine variants; the other mesh x layers x
# schedule combinations run in make test-extended.
EXTENDED.update(
    {
        f"tests/test_pipeline.py::test_decoder_trains_in_stages_as_on_one_device[{mesh}-{kind}-{sched}]": "variant"
        for mesh, kind, sched in (
            ("stage4-data2", "list", "gpipe"),
            ("stage4-data2", "list", "circular"),
            ("stage2-fsdp2-tensor2", "scan", "gpipe"),
            ("stage2-fsdp2-tensor2", "scan", "circular"),
            ("stage2-fsdp2-tensor2", "list", "gpipe"),
        )
    }
)
EXTENDED.update(
    {
        "tests/test_pipeline.py::test_pipeline_matches_the_layers_run_in_order[gpipe-remat-m2]": "variant",
        "tests/test_pipeline.py::test_pipeline_matches_the_layers_run_in_order[circular]": "variant",
        "tests/test_pipeline.py::test_flax_model_with_a_list_of_blocks_trains_in_stages_as_on_one_device"
        "[circular-False]": "variant",
    }
)

# Six parallelisms together: make test keeps all six axes on the scanned MoE decoder (stage
# with expert and context inside, gather mode), context in stages as a list (ring) and the
# MoE decoder in stages as a list; the other layer/mode pairs run in make test-extended.
EXTENDED.update(
    {
        "tests/test_compose.py::test_moe_decoder_trains_in_stages_as_on_one_device[scan]": "variant",
        "tests/test_compose.py::test_decoder_with_context_trains_in_stages_as_on_one_device"
        "[scan-gather]": "variant",
        "tests/test_compose.py::test_decoder_with_context_trains_in_stages_as_on_one_device"
        "[scan-ring]": "variant",
        "tests/test_compose.py::test_decoder_with_context_trains_in_stages_as_on_one_device"
        "[list-gather]": "variant",
        "tests/test_compose.py::test_all_six_axes_at_once_train_as_on_one_device[list]": "variant",
    }
)

# The decoder under a context axis: each mesh of the issue keeps one mode in make test
# (context=4 x data=2 gather; context=2 x fsdp=2 x tensor=2 scanned with remat, gather too:
# ring mode on the decoder runs in test_compose's list-ring, at two thirds of the time).
EXTENDED.update(
    {
        "tests/test_context.py::test_decoder_trains_under_hybrid_context_as_on_one_device"
        "[context4-data2-ring]": "variant",
        "tests/test_context.py::test_decoder_trains_under_hybrid_context_as_on_one_device"
        "[fsdp2-tensor2-context2-scan-remat-ring]": "variant",
        # MixedPrecision's casts: fully_sharded and hybrid stay in make test
        "tests/strategies/test_fsdp_options.py::test_mixed_precision_matches_single_device_with"
        "_the_same_casts[fully_sharded_keep]": "variant",
        "tests/strategies/test_fsdp_options.py::test_mixed_precision_matches_single_device_with"
        "_the_same_casts[mirrored]": "variant",
    }
)


# make test's time (over its 10 minutes on 2 cores): variants whose paths make test runs in
# another test. Remat inside stages: the engine's remat runs (MixedPrecision inside stages is
# then tested in make test-extended only); the scanned decoder in stages with GPipe: the
# circular one and the six-axes run; Flax's attention under context keeps one mask/mode pair
# each way; Flax's Gemma keeps the gather plan's remat run; the chunked loss keeps the MoE
# decoder.
EXTENDED.update(
    {
        "tests/test_pipeline.py::test_decoder_in_stages_with_remat_and_mixed_precision_matches"
        "_unpipelined": "variant",
        "tests/test_pipeline.py::test_decoder_trains_in_stages_as_on_one_device"
        "[stage4-data2-scan-gpipe]": "variant",
        **{
            "tests/test_context.py::test_flax_attention_trains_under_hybrid_context_unchanged"
            f"[{kind}]": "variant"
            for kind in (
                "mha-full-gather",
                "mha-full-ring",
                "mha-causal-mask-ring",
                "dot_product_attention-is_causal-gather",
            )
        },
        "tests/test_flax_gemma.py::test_flax_gemma_trains_under_fully_sharded_as_on_one_device"
        "[xla-remat]": "variant",
        "tests/test_context.py::test_chunked_cross_entropy_is_the_loss_and_gradients_of_whole"
        "_logits[tiny]": "variant",
    }
)


# The interleaved schedules: make test trains the decoder by interleaved 1F1B (a list under
# stage x data) and zero-bubble (scanned under stage x fsdp x tensor), the MoE decoder by
# 1F1B with experts and context (scanned), Flax's model by zero-bubble, Flax's Gemma in
# stages (GPipe: the list of pairs) and compiles 1F1B for explain; the other pairings run in
# make test-extended.
EXTENDED.update(
    {
        **{
            f"tests/test_schedules.py::test_decoder_trains_by_each_schedule_as_on_one_device[{k}]": "variant"
            for k in (
                "1f1b-scan-dims0",
                "1f1b-list-dims1",
                "interleaved-1f1b-scan-dims2",
                "zero-bubble-list-dims5",
            )
        },
        "tests/test_schedules.py::test_1f1b_with_remat_and_mixed_precision_matches_the"
        "_unpipelined_preset": "variant",
        **{
            f"tests/test_flax_gemma.py::test_flax_gemma_trains_in_pipeline_stages_as_on_one_device[{k}]": "variant"
            for k in ("1f1b", "zero-bubble", "interleaved-1f1b")
        },
    }
)


# ------------------------------------------------- what `make test-latest` runs beyond make test
# make test-latest runs make test's suite on the newest jax/flax/optax (where float32 drift in
# the equality tests was first seen) and, marked `latest`, these extended equality tests of the
# newer axes: stage, context, expert and their compositions, one of each mesh x layers (x mode)
# pairing that make test does not train (the other schedules, modes and Flax-model variants of
# the same pairings stay in make test-extended only).
LATEST = {
    "tests/test_pipeline.py::test_decoder_trains_in_stages_as_on_one_device"
    "[stage2-fsdp2-tensor2-scan-gpipe]",
    "tests/test_pipeline.py::test_decoder_trains_in_stages_as_on_one_device"
    "[stage4-data2-list-gpipe]",
    "tests/test_pipeline.py::test_decoder_in_stages_with_remat_and_mixed_precision_matches"
    "_unpipelined",
    "tests/test_context.py::test_decoder_trains_under_hybrid_context_as_on_one_device"
    "[context4-data2-ring]",
    "tests/test_context.py::test_decoder_trains_under_hybrid_context_as_on_one_device"
    "[fsdp2-tensor2-context2-scan-remat-ring]",
    "tests/test_experts.py::test_moe_decoder_trains_under_hybrid_expert_as_on_one_device"
    "[data2-fsdp2-expert2]",
    "tests/test_experts.py::test_moe_decoder_trains_under_hybrid_expert_as_on_one_device"
    "[fsdp2-expert4-scan-remat]",
    "tests/test_compose.py::test_moe_decoder_trains_in_stages_as_on_one_device[scan]",
    "tests/test_compose.py::test_decoder_with_context_trains_in_stages_as_on_one_device[scan-ring]",
    "tests/test_compose.py::test_all_six_axes_at_once_train_as_on_one_device[list]",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marker set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[str] = set()
    files = {item.nodeid.split("::")[0] for item in items}
    for item in items:
        keys = (item.nodeid, item.nodeid.split("[")[0])  # the test, its function
        for key in (k for k in keys if k in EXTENDED):
            item.add_marker(pytest.mark.extended)
            seen.add(key)
        for key in (k for k in keys if k in LATEST):
            if not item.get_closest_marker("extended"):  # make test runs it already
                raise pytest.UsageError(f"tests/conftest.py LATEST names {key}, not extended.")
            item.add_marker(pytest.mark.latest)
            seen.add(key)
    stale = [k for k in (*EXTENDED, *LATEST) if k not in seen and k.split("::")[0] in files]
    if stale and not any("::" in arg for arg in config.args):  # not when one test is named
        raise pytest.UsageError(
            f"tests/conftest.py EXTENDED or LATEST names tests that were not collected: {stale}; "
            "update the names (a renamed test must stay in one of make test / make test-extended)."
        )


# ----------------------------------------------------------- the long tests first, on two workers
# --dist loadgroup hands out the xdist groups first (the most tests first), then one test at a time
# in collection order: a long test collected late (test_tpu.py's compiles, say) ran alone at the
# end while the other worker had finished. These run first, longest first (seconds measured on the
# 2-core machine with `--durations`), so that the short tests fill in at the end and both workers
# end together. A name here that matches nothing is only a missed hint: it fails nothing.
FIRST = ("tests/test_demo.py::test_demo_ctrl_c_in_a_bucket_then_resumes_model_optimizer_and_data",)


def _first(item: pytest.Item) -> int:
    """Where ``item`` goes among FIRST's (after them all when it is not there)."""
    nodeid = item.nodeid.partition("@")[0]
    for rank, name in enumerate(FIRST):
        if nodeid == name or nodeid.startswith(name + "["):
            return rank
    return len(FIRST)


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported lives as long as the process: out of the collector's passes.
    gc.collect()
    gc.freeze()


class _XdistGroups:
    """``--dist loadgroup``'s ``xdist_group`` marks, honoured again.

    pytest-xdist 3.8 sends a group to one worker by the ``@group`` suffix its worker
    hook adds to each item's node id (``item._nodeid``); pytest 9 keeps node ids in
    ``item._id`` instead, so the suffix never appears and every ``xdist_group`` mark is
    ignored: a module's expensive fixture runs on both workers, and the multi-process tests
    a group keeps apart start processes at once on 2 cores. This adds the suffix where
    pytest now keeps it (an xdist release that does it itself leaves nothing to add).
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
            return
        items.sort(key=_first)  # stable: the rest keep their order
        try:
            from _pytest.nodeid import NodeId
        except ImportError:  # pytest < 9: xdist's own hook did it
            return
        for item in items:
            marks = item.iter_markers("xdist_group")
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in marks})  # fmt: skip
            if names and "@" not in item.nodeid.rpartition("]")[2]:
                item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_XdistGroups(), "dtensor-xdist-groups")
