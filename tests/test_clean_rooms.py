"""Clean rooms: each model file copies alone (its imports point one way), and a library call computes and
returns: it times nothing, writes nothing the caller did not ask for, and leaves the process as it was."""
import ast
import concurrent.futures
import functools
import json
import os
import re
import shutil
import subprocess
import sys

import torch

import dualAR
import omnivoice
from conftest import CKPT, OV_CKPT, ROOT

# the repository's modules
FILES = ("common", "codec", "cpu_fast", "dualAR", "bench", "omnivoice", "omnivoice_codec", "omnivoice_text",
         "app", "quantize", "train_lora", "train_omnivoice", "training", "wyoming_server")


def imported_with(module: str) -> set:
    """The other repository modules that `import module` brings in, in a fresh process."""
    return every_import()[module]


@functools.cache  # the same answers for the whole session
def every_import() -> dict:
    """{module: imported_with(module)} for every module of FILES, a fresh process each, as many at a time
    as there are cores (each mostly imports torch, on one core)."""
    def brought_in(module):
        others = f"(m for m in {FILES!r} if m in sys.modules and m != {module!r})"
        run = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(*{others})"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return set(run.stdout.split())

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(FILES, pool.map(brought_in, FILES)))


def test_imports_point_one_way_common_below_the_models_and_nothing_imports_the_benchmark():
    assert imported_with("common") == set()  # no model: a model file is copied with common.py alone
    assert imported_with("codec") == {"common"}
    assert imported_with("dualAR") == {"common"}  # codec.py only inside the CLI and demo functions
    assert imported_with("omnivoice_codec") == {"common"}
    assert imported_with("omnivoice_text") == {"common"}
    assert imported_with("omnivoice") == {"common", "omnivoice_codec", "omnivoice_text"}  # no S2 dragged in
    assert imported_with("quantize") == {"common"}  # a model file imports it only where a scheme is asked
    assert imported_with("cpu_fast") == {"common", "quantize"}  # the models import it (in their CLIs)
    # the Wyoming server is given app.py's objects, and app.py imports it only for --wyoming-port
    assert imported_with("wyoming_server") == {"common", "omnivoice_text"}
    assert "wyoming_server" not in imported_with("app")
    for module in FILES:  # nothing imports the benchmark, at any depth (a circle would show here)
        if module != "bench":
            assert "bench" not in imported_with(module), module
    for path in ROOT.glob("*.py"):  # nor inside a function
        if path.stem != "bench":
            assert "import bench" not in path.read_text(), path.name


def test_common_holds_only_what_a_model_file_uses():
    """Each name common.py defines is used by a model file (its CLI included) or by common.py itself: what
    only the trainers share is training.py's, what only the CPU tuner needs is cpu_fast.py's."""
    source = (ROOT / "common.py").read_text()
    models = " ".join((ROOT / f"{m}.py").read_text() for m in ("dualAR", "codec", "omnivoice",
                                                               "omnivoice_codec", "omnivoice_text"))
    defined = (ast.FunctionDef, ast.ClassDef)
    names = [node.name for node in ast.parse(source).body if isinstance(node, defined)]
    assert len(names) > 20
    unused = [name for name in names if not re.search(rf"\b{name}\b", models)
              and len(re.findall(rf"\b{name}\b", source)) < 2]
    assert unused == []
    assert imported_with("training") == set()


def test_no_import_circle_at_any_depth_not_even_inside_a_function():
    """Every import of a repository module, wherever it stands in a file, is an arrow: they form no circle
    (a file in a circle cannot be copied without the files that import it)."""
    arrows = {}
    for path in [*ROOT.glob("*.py"), *ROOT.glob("tools/*.py")]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        arrows[path.stem] = names & set(FILES)
    assert arrows["dualAR"] >= {"cpu_fast", "codec"} and arrows["cpu_fast"] == {"common", "quantize"}

    def reaches(start, module, seen):
        return any(other == start or other not in seen and (seen.add(other) or reaches(start, other, seen))
                   for other in arrows.get(module, ()))
    assert [module for module in arrows if reaches(module, module, set())] == []


def test_no_module_changes_its_class_at_run_time_or_reaches_back_into_the_module_that_loaded_it():
    """What runs is what print(model) shows: faster modules take the plain ones' place (cpu_fast.replaced);
    no file sets a module's __class__ or looks a model file up in sys.modules."""
    for path in [*ROOT.glob("*.py"), *ROOT.glob("tools/*.py")]:
        text = path.read_text()
        assert ".__class__ =" not in text and "__class__, " not in text, path.name
        assert "sys.modules[" not in text, path.name


LIBRARY_CALLS = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch._dynamo, torch._inductor.config
environ = dict(os.environ)
configs = [c.get_config_copy() for c in (torch._dynamo.config, torch._inductor.config)]
import codec, dualAR, omnivoice
model = dualAR.load({str(CKPT)!r})
codes = dualAR.generate(model, "Hi there.", seed=1, max_new_tokens=6)
many = dualAR.generate_many(model, [dict(text="Hi.", seed=2, max_new_tokens=4)] * 2, slots=2)
chunks = list(dualAR.stream(model, "Hi.", seed=3, max_new_tokens=4))
dac = codec.load({str(CKPT)!r})
wave = codec.decode(dac, codes)
again = codec.encode(dac, wave[0])
ov = omnivoice.load({str(OV_CKPT)!r})
audio = omnivoice.generate(ov, "Hello there.", language="en", seed=0, num_step=4)
packed = omnivoice.generate(ov, "Hello there.", language="en", seed=0, num_step=4, packed=True)
linears = [m for net in (model, dac, ov) for m in net.modules() if isinstance(m, torch.nn.Linear)]
classes = sorted({{type(m).__name__ for m in linears}})
print(json.dumps(dict(classes=classes, environ=dict(os.environ) == environ, configs=[
    sorted(k for k, v in c.get_config_copy().items() if v != before[k])
    for c, before in zip((torch._dynamo.config, torch._inductor.config), configs)])))
"""


def test_library_calls_time_nothing_write_nothing_and_leave_the_process_as_it_was(tmp_path):
    """S2-Pro's generate / generate_many / stream, the codec's decode / encode and OmniVoice's generate
    (upstream's rows and packed) on a plain model: in a fresh process with a fresh HOME, nothing is
    printed about timing, no file appears under HOME (no decision file, no compile cache), os.environ and
    dynamo's and inductor's configs are unchanged, and the models keep plain nn.Linear layers."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR")}
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    run = subprocess.run([sys.executable, "-c", LIBRARY_CALLS], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got == dict(classes=["Linear"], environ=True, configs=[[], []])  # the model is left plain
    assert "cpu_fast" not in run.stderr and "timing" not in run.stderr
    assert [p for p in (tmp_path / "home").rglob("*")] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


COPIED_MODEL = """
import sys
import torch
sys.path.insert(0, ".")
import dualAR, omnivoice
s2 = dualAR.generate(dualAR.load(sys.argv[1]), "Hi there.", seed=1, max_new_tokens=6)
ov = omnivoice.generate(omnivoice.load(sys.argv[2]), "Hello there.", language="en", seed=0, num_step=4)
modules = sorted(m for m in sys.modules if m.split(".")[0] in {files})
torch.save(dict(s2=s2, ov=torch.as_tensor(ov), modules=modules), "out.pt")
"""


def test_a_model_file_copies_with_common_py_alone_and_generates_as_in_the_repository(tmp_path):
    """dualAR.py with common.py, and omnivoice.py with its own two helpers and common.py, copied into an
    empty folder, generate on the tiny checkpoints what they generate here (no quantize.py, cpu_fast.py
    or codec.py needed, none imported)."""
    copied = ["dualAR.py", "common.py", "omnivoice.py", "omnivoice_codec.py", "omnivoice_text.py",
              "omnivoice_languages.tsv"]
    for name in copied:
        shutil.copy(ROOT / name, tmp_path / name)
    script = COPIED_MODEL.format(files=set(FILES))
    run = subprocess.run([sys.executable, "-c", script, str(CKPT), str(OV_CKPT)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["modules"] == ["common", "dualAR", "omnivoice", "omnivoice_codec", "omnivoice_text"]
    assert torch.equal(got["s2"], dualAR.generate(dualAR.load(CKPT), "Hi there.", seed=1, max_new_tokens=6))
    here = omnivoice.generate(omnivoice.load(OV_CKPT), "Hello there.", language="en", seed=0, num_step=4)
    assert torch.equal(got["ov"], torch.as_tensor(here))
