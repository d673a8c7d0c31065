// The one error convention of deepreduce's C++ code.
//
// A function that cannot do what it was asked throws deepreduce::Error: its message is the
// deepreduce core's own text for the problem, its kind names the Python error class that text
// belongs to. No function reports an error any other way (no return codes, no error strings),
// and nothing reads out of bounds to find out.
//
// Error derives from std::invalid_argument, so pybind11 raises it as ValueError without a
// translator (the Python codecs re-raise that as their deepreduce error); py_args.h raises the
// Communication and Overflow kinds as deepreduce.errors.CommunicationError and
// NonFiniteGradientError. The TensorFlow op glue turns an
// Error into InvalidArgument("<kind name>: <message>"), which ops.py raises as that class.
#pragma once

#include <stdexcept>
#include <string>

namespace deepreduce {

enum class ErrorKind {
    ARGUMENT,       // a caller passed an argument out of its documented range (ValueError)
    CONTAINER,      // a received buffer is not a valid container (ContainerError)
    COMMUNICATION,  // ranks disagree: shapes, counts, residual sizes (CommunicationError)
    ENCODE,         // a tensor cannot be encoded as configured (DeepReduceError)
    OVERFLOW,       // error-feedback compensation is not finite (NonFiniteGradientError)
};

class Error : public std::invalid_argument {
  public:
    Error(ErrorKind kind, const std::string& message) : std::invalid_argument(message), kind_(kind) {}
    ErrorKind kind() const noexcept { return kind_; }
    // The deepreduce (or Python) class name of the kind.
    const char* kind_name() const noexcept {
        switch (kind_) {
            case ErrorKind::CONTAINER:
                return "ContainerError";
            case ErrorKind::COMMUNICATION:
                return "CommunicationError";
            case ErrorKind::ENCODE:
                return "DeepReduceError";
            case ErrorKind::OVERFLOW:
                return "NonFiniteGradientError";
            default:
                return "ValueError";
        }
    }

  private:
    ErrorKind kind_;
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string& message) {
    throw Error(kind, message);
}

}  // namespace deepreduce
