// pybind11 binding of the seed derivation (seeding.h): deepreduce._seeding. deepreduce/wire/seeding.py
// derives its seeds through it when it is built (hashlib otherwise; tests compare the two).
#include "common/py_args.h"
#include "seeding.h"

namespace py = pybind11;

PYBIND11_MODULE(_seeding, m) {
    deepreduce::py_args::register_errors();
    m.doc() = "Seed derivation of deepreduce (BLAKE2b-64 of digest, name, step, purpose)";
    m.def("derive_seed", &deepreduce::seeding::derive_seed, py::arg("digest"), py::arg("name"), py::arg("step"),
          py::arg("purpose") = "", "the 64-bit seed of one (config digest, tensor name, step, purpose)");
}
