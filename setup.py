"""Build and install deepreduce.

Every folder ``csrc/<name>/`` with a ``py_module.cpp`` becomes the pybind11 extension
``deepreduce._<name>`` (all ``*.cpp`` of the folder and of the folders it calls, ``CALLS``, except
the TensorFlow op files ``tf_*.cpp``, which scripts/build_tf_ops.sh compiles against TensorFlow). The extensions are optional at run
time: if one fails to build, installation continues and deepreduce falls back to its NumPy path
with a warning that says how to rebuild.

Only numpy, pyyaml, scipy, bitarray and array-api-compat are required; ``pip install "deepreduce[torch]"`` adds
torch (an installed torch that satisfies it is left alone), and Horovod and TensorFlow are the
extras ``horovod`` and ``tensorflow``. pyproject.toml declares the build requirements.
"""
import glob
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def sanitizer_flags():
    """``DEEPREDUCE_SANITIZE=address,undefined`` (``make fuzz``): instrument the extensions at
    compile time only; the sanitizer runtime is not linked in but preloaded (atheris ships one
    with its fuzzer), so a single runtime serves the interpreter and every extension."""
    checks = os.environ.get("DEEPREDUCE_SANITIZE", "")
    if not checks:
        return []
    return [f"-fsanitize={checks}", "-fno-sanitize=vptr", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g"]


#: The other csrc folders whose code an extension calls: their sources are compiled into it too.
#: (csrc/common holds headers only: the error convention, the argument checks, the thread limit.)
CALLS = {
    "bloom": ("container",),   # the varints of the Bloom params
    "pipeline": ("bloom", "container", "fit", "seeding", "select"),
}


def library_sources(folder):
    """The plain C++ sources of a csrc folder: neither the pybind11 module nor TensorFlow op files."""
    return sorted(s for s in glob.glob(os.path.join(folder, "*.cpp"))
                  if os.path.basename(s) != "py_module.cpp" and not os.path.basename(s).startswith("tf_"))


def native_extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        print("[deepreduce] pybind11 not installed: building without C++ extensions", file=sys.stderr)
        return []
    modules = []
    for entry in sorted(glob.glob(os.path.join("csrc", "*", "py_module.cpp"))):
        folder = os.path.dirname(entry)
        name = os.path.basename(folder)
        folders = [folder] + [os.path.join("csrc", other) for other in CALLS.get(name, ())]
        sources = [entry] + [s for f in folders for s in library_sources(f)]
        modules.append(Pybind11Extension(
            f"deepreduce._{name}", sources,
            include_dirs=[*folders, "csrc"], cxx_std=17, extra_compile_args=["-O3", *sanitizer_flags()],
        ))
    return modules


class OptionalBuildExt(build_ext):
    """Builds each extension, warning instead of failing when a compiler error occurs.

    The extensions build in parallel (one per CPU unless ``--parallel``/``-j`` says otherwise).
    """

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # compiler missing or failing: keep the NumPy fallback
            print(f"[deepreduce] WARNING: could not build {ext.name}: {exc}; the NumPy path will be used",
                  file=sys.stderr)


setup(
    name="deepreduce",
    version="0.1.0",
    description="Compressed communication of sparse gradient tensors for data-parallel training",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["deepreduce", "deepreduce.*"]),
    package_data={"deepreduce": ["configs/*.yaml"]},
    ext_modules=native_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=["numpy>=1.26", "pyyaml>=6", "scipy>=1.11", "bitarray>=2.8", "array-api-compat>=1.10"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "horovod": ["horovod==0.28.1"],
        "mpi": ["mpi4py>=3.1"],
        "plots": ["matplotlib>=3.7", "tqdm>=4.60"],
        "test": ["pytest>=7", "hypothesis>=6", "pybloomfiltermmap3>=0.6", "scikit-learn>=1.3"],
    },
    entry_points={"console_scripts": ["deepreduce=deepreduce.cli:main"]},
)
