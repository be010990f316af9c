/* The default's choice where no cache is at stake, compiled: llm_policies._least_requests.

   Most of the default's choices (no prompt, or one no candidate holds) pick the candidate with
   the fewest requests, ours + foreign by each candidate's fresh engine snapshot, a tie taken in
   turn (the oldest stamp in the workers' turns file). In Python, a worker's whole request on the
   compiled front's path (in process, the 2-core box, fresh snapshots) took 37.0 / 46.9 / 58.3 us
   at 2 / 8 / 16 instances with that pass and the tie's stamps read apart; with this, 32.9 / 40.2 /
   50.4 (least-outstanding: 26.0 / 30.7 / 36.3). Of what is left, this pass is ~4 us at 16: the
   attribute look-ups on the Python objects it reads. It is the same pass, look-up for look-up,
   and leaves to the Python every case that is
   not the plain one (a stale or missing snapshot, terms not worked out for the latest snapshot,
   a number that is not an int), so the Python keeps every rule and this module none of its own.
   tests/test_llm_policies.py holds both to the same choices on random states. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *s_engine, *s_latest, *s_iteration, *s_at, *s_stale_after_s, *s_instance_id;

/* A float attribute of `obj` (an int accepted) into *out; 0 where it is neither (or missing). */
static int float_attr(PyObject *obj, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    int ok = 1;
    if (PyFloat_CheckExact(v)) *out = PyFloat_AS_DOUBLE(v);
    else if (PyLong_CheckExact(v)) {
        *out = PyLong_AsDouble(v);
        if (*out == -1.0 && PyErr_Occurred()) ok = -1;
    } else ok = 0;
    Py_DECREF(v);
    return ok;
}

/* An exact int into *out; 0 where `v` is not one, or does not fit. */
static int int_value(PyObject *v, long long *out) {
    if (!PyLong_CheckExact(v)) return 0;
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow) return 0;
    if (*out == -1 && PyErr_Occurred()) return -1;
    return 1;
}

PyDoc_STRVAR(least_doc,
"least(candidates, inflight, now, terms) -> int | list | None\n\n"
"Of `candidates` (a list or tuple of Backends), by requests = ours + foreign (llm_policies._counted):\n"
"the index of the only one with the fewest, or the list of those tied for it in their order.\n"
"None where the Python must decide: a candidate without an engine view, a fresh snapshot\n"
"(`latest`, its `iteration` set, `now - at <= stale_after_s`) or the terms of it in `terms`\n"
"(instance_id -> (snapshot, our count then or None, its requests, its KV term)), or a count\n"
"that is not an int. `inflight` must be a dict (instance_id -> our count; missing: 0).\n\n"
"With `stamps` (the turns file, shared_stamps.py) and `cells` (each candidate's float64 cell there),\n"
"a tie is broken there as SharedTurns.oldest breaks it: the first of the tied with the lowest\n"
"stamp; its index is returned. IndexError where a cell lies beyond the buffer.");

static PyObject *least(PyObject *self, PyObject *args) {
    PyObject *candidates, *inflight, *terms, *cells = Py_None;
    double now;
    Py_buffer stamps = {0};
    if (!PyArg_ParseTuple(args, "OO!dO!|y*O", &candidates, &PyDict_Type, &inflight, &now, &PyDict_Type, &terms,
                          &stamps, &cells))
        return NULL;
    PyObject *seq = PySequence_Fast(candidates, "candidates: must be a list or a tuple");
    if (seq == NULL) {
        if (stamps.obj != NULL) PyBuffer_Release(&stamps);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (cells != Py_None && (stamps.obj == NULL || !PyList_CheckExact(cells) || PyList_GET_SIZE(cells) != n)) {
        PyErr_SetString(PyExc_ValueError, "cells: must be a list of a cell per candidate, with `stamps`");
        if (stamps.obj != NULL) PyBuffer_Release(&stamps);
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t *tied = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (tied == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t ntied = 0;
    long long low = 0;
    int fallback = 0;
    for (Py_ssize_t i = 0; i < n && !fallback; i++) {
        PyObject *b = items[i], *view = NULL, *snap = NULL, *iteration = NULL, *iid = NULL;
        int step = -1;  /* -1: an error; 0: the Python decides; 1: counted */
        long long requests = 0;
        view = PyObject_GetAttr(b, s_engine);
        if (view == NULL) goto next;
        if (view == Py_None) { step = 0; goto next; }
        snap = PyObject_GetAttr(view, s_latest);
        if (snap == NULL) goto next;
        if (snap == Py_None) { step = 0; goto next; }
        iteration = PyObject_GetAttr(snap, s_iteration);
        if (iteration == NULL) goto next;
        if (iteration == Py_None) { step = 0; goto next; }
        double at, stale_after;
        int ok = float_attr(snap, s_at, &at);
        if (ok == 1) ok = float_attr(view, s_stale_after_s, &stale_after);
        if (ok != 1) { step = ok; goto next; }
        if (now - at > stale_after) { step = 0; goto next; }
        iid = PyObject_GetAttr(b, s_instance_id);
        if (iid == NULL) goto next;
        long long ours = 0, then, engine;
        PyObject *count = PyDict_GetItemWithError(inflight, iid);  /* borrowed */
        if (count == NULL && PyErr_Occurred()) goto next;
        if (count != NULL && (ok = int_value(count, &ours)) != 1) { step = ok; goto next; }
        PyObject *t = PyDict_GetItemWithError(terms, iid);  /* borrowed */
        if (t == NULL) { step = PyErr_Occurred() ? -1 : 0; goto next; }
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) < 3 || PyTuple_GET_ITEM(t, 0) != snap) {
            step = 0;
            goto next;
        }
        PyObject *then_obj = PyTuple_GET_ITEM(t, 1);
        if (then_obj == Py_None) then = ours;
        else if ((ok = int_value(then_obj, &then)) != 1) { step = ok; goto next; }
        if ((ok = int_value(PyTuple_GET_ITEM(t, 2), &engine)) != 1) { step = ok; goto next; }
        long long foreign = engine - then;
        requests = foreign > 0 ? ours + foreign : ours;
        step = 1;
    next:
        Py_XDECREF(view);
        Py_XDECREF(snap);
        Py_XDECREF(iteration);
        Py_XDECREF(iid);
        if (step < 0) goto done;
        if (step == 0) { fallback = 1; break; }
        if (ntied == 0 || requests < low) {
            low = requests;
            tied[0] = i;
            ntied = 1;
        } else if (requests == low) {
            tied[ntied++] = i;
        }
    }
    if (fallback || ntied == 0) {
        out = Py_NewRef(Py_None);
    } else if (ntied == 1) {
        out = PyLong_FromSsize_t(tied[0]);
    } else if (cells != Py_None) {
        /* SharedTurns.oldest: the stamps read together, the first of the lowest taken */
        const double *cell = (const double *)stamps.buf;
        Py_ssize_t ncells = stamps.len / (Py_ssize_t)sizeof(double), pick = -1;
        double oldest = 0.0;
        for (Py_ssize_t k = 0; k < ntied; k++) {
            Py_ssize_t c = PyLong_AsSsize_t(PyList_GET_ITEM(cells, tied[k]));
            if (c == -1 && PyErr_Occurred()) goto done;
            if (c < 0 || c >= ncells) {
                PyErr_SetString(PyExc_IndexError, "a cell beyond the stamps");
                goto done;
            }
            double v = cell[c];
            if (pick < 0 || v < oldest) {
                oldest = v;
                pick = tied[k];
            }
        }
        out = PyLong_FromSsize_t(pick);
    } else {
        out = PyList_New(ntied);
        if (out != NULL)
            for (Py_ssize_t k = 0; k < ntied; k++) PyList_SET_ITEM(out, k, Py_NewRef(items[tied[k]]));
    }
done:
    if (stamps.obj != NULL) PyBuffer_Release(&stamps);
    PyMem_Free(tied);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"least", least, METH_VARARGS, least_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_least_requests",
    "The default's choice where no cache is at stake, compiled (llm_policies._least_requests).", -1, methods,
};

PyMODINIT_FUNC PyInit__least_requests(void) {
    if (!(s_engine = PyUnicode_InternFromString("engine")) || !(s_latest = PyUnicode_InternFromString("latest"))
        || !(s_iteration = PyUnicode_InternFromString("iteration")) || !(s_at = PyUnicode_InternFromString("at"))
        || !(s_stale_after_s = PyUnicode_InternFromString("stale_after_s"))
        || !(s_instance_id = PyUnicode_InternFromString("instance_id")))
        return NULL;
    return PyModule_Create(&module);
}
