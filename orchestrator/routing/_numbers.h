/* Python numbers into C ones, as the routing's compiled passes read them (_least_requests.c,
   _cost_pass.c): 1 where read, 0 where the value is not the plain kind (the caller leaves the
   case to the Python), -1 on an error (set). */
#ifndef TRTLLM_ORCH_ROUTING_NUMBERS_H
#define TRTLLM_ORCH_ROUTING_NUMBERS_H
#include <Python.h>

/* An exact int into *out; 0 where `v` is not one, or does not fit. */
static int int_value(PyObject *v, long long *out) {
    if (!PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 0;
    if (*out == -1 && PyErr_Occurred()) return -1;
    return 1;
}

/* A float or an int into *out, as Python mixes them into floats; 0 where `v` is neither. */
static int float_value(PyObject *v, double *out) {
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 1;
    }
    if (!PyLong_CheckExact(v)) return 0;
    *out = PyLong_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 1;
}

#endif
