/* The default's choice where no cache is at stake, compiled: llm_policies._least_requests.

   Most of the default's choices (no prompt, or one no candidate holds) pick the candidate with
   the fewest requests, ours + foreign by each candidate's fresh engine snapshot, a tie taken in
   turn (the oldest stamp in the workers' turns file), every count read noted there. A worker's
   whole request on the compiled front's path (in process, the 2-core box, fresh snapshots) took
   39.7 / 51.3 / 66.2 us at 2 / 8 / 16 instances in Python (`_least` over `_counted`: two dicts
   built, the tie's stamps read and the counts written apart; 37.0 / 46.9 / 58.3 with a one-pass
   copy, not kept); 32.9 / 40.2 / 50.4 with the pass here on the Backend objects (6
   attribute look-ups a candidate); 31.6 / 38.4 / 47.0 as it is now, on the candidates' ids and
   views as lists (kept per ready set, llm_policies.ReadyLists), the tie and the counts here too
   (least-outstanding: 26.0 / 30.7 / 36.3). It is the same pass, and leaves to the Python every
   case that is not the plain one (a candidate without a view, a stale snapshot, terms not worked
   out of the latest snapshot, a number that is not an int, counts of instances that are not
   candidates to note), so the Python keeps every rule and this module none of its own.
   `counted` is the pass of llm_policies._counted alike (the two dicts every holder's weighing reads:
   a worker's request with a 2048-character tenant prompt, in process, 84.9 / 91.6 / 100.4 ->
   83.1 / 88.4 / 93.3 us at 2 / 8 / 16 instances).
   tests/test_llm_policies.py holds both to the same choices and the same file on random states. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_numbers.h"

static PyObject *s_latest, *s_stale_after_s;

/* Candidate i's requests (ours + foreign) into *requests, its count into *ours: 1; 0 where the
   Python must decide; -1 on an error. */
static int count(PyObject *iid, PyObject *view, PyObject *inflight, PyObject *terms, double now,
                 long long *requests, long long *ours, int *found, double *kv) {
    if (view == Py_None) return 0;
    /* The view's attributes first: a look-up may run Python (a property), which could change the
       dicts whose items are borrowed below; after it, nothing runs Python (exact str keys, exact
       ints and floats). */
    PyObject *snap = PyObject_GetAttr(view, s_latest);
    if (snap == NULL) return -1;
    Py_DECREF(snap);  /* compared by identity only; the view keeps it */
    double at, stale_after;
    PyObject *stale = PyObject_GetAttr(view, s_stale_after_s);
    if (stale == NULL) return -1;
    int ok = float_value(stale, &stale_after);
    Py_DECREF(stale);
    if (ok != 1) return ok;
    PyObject *t = PyDict_GetItemWithError(terms, iid);  /* borrowed */
    if (t == NULL) return PyErr_Occurred() ? -1 : 0;
    /* the terms are of the view's latest snapshot: one with TRT-LLM numbers (terms are worked out
       of no other), its time kept beside them */
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) < 5 || PyTuple_GET_ITEM(t, 0) != snap) return 0;
    if ((ok = float_value(PyTuple_GET_ITEM(t, 4), &at)) != 1) return ok;
    if (now - at > stale_after) return 0;
    *ours = 0;
    PyObject *n = PyDict_GetItemWithError(inflight, iid);  /* borrowed */
    if (n == NULL && PyErr_Occurred()) return -1;
    *found = n != NULL;
    if (n != NULL && (ok = int_value(n, ours)) != 1) return ok;
    long long then, engine;
    PyObject *then_obj = PyTuple_GET_ITEM(t, 1);
    if (then_obj == Py_None) then = *ours;
    else if ((ok = int_value(then_obj, &then)) != 1) return ok;
    if ((ok = int_value(PyTuple_GET_ITEM(t, 2), &engine)) != 1) return ok;
    long long foreign = engine - then;
    *requests = foreign > 0 ? *ours + foreign : *ours;
    return kv == NULL ? 1 : float_value(PyTuple_GET_ITEM(t, 3), kv);
}

PyDoc_STRVAR(least_doc,
"least(ids, views, inflight, now, terms, stamps=None, cells=None, counts_at=-1) -> int | list | None\n\n"
"Of the candidates (their instance ids and engine views, two lists in their order), by requests =\n"
"ours + foreign (llm_policies._counted): the index of the only one with the fewest, or the list of\n"
"the indexes tied for it. None where the Python must decide: a candidate without a view, or whose\n"
"view's latest snapshot is not the one its `terms` were worked out of (instance_id -> (snapshot,\n"
"our count then or None, its requests, its KV term, its time)), or is stale (now - time >\n"
"stale_after_s), or a count that is not an int. `inflight`: a dict, instance_id -> our count\n"
"(missing: 0).\n\n"
"With `stamps` (the turns file's bytes, shared_stamps.py) and `cells` (each candidate's float64\n"
"cell there), a tie is broken as SharedTurns.oldest breaks it: the first of the tied with the\n"
"lowest stamp; its index is returned. With `counts_at` >= 0 too, each candidate's count is also\n"
"written at its cell + counts_at (SharedStamps.note_counts of `inflight`), and only where\n"
"`inflight` holds exactly the candidates; None (nothing written) where it does not.\n"
"IndexError where a cell lies beyond the buffer.");

static PyObject *least(PyObject *self, PyObject *args) {
    PyObject *ids, *views, *inflight, *terms, *stamps_obj = Py_None, *cells = Py_None;
    double now;
    Py_ssize_t counts_at = -1;
    Py_buffer stamps = {0};
    if (!PyArg_ParseTuple(args, "O!O!O!dO!|OOn", &PyList_Type, &ids, &PyList_Type, &views, &PyDict_Type,
                          &inflight, &now, &PyDict_Type, &terms, &stamps_obj, &cells, &counts_at))
        return NULL;
    /* the counts are written there: a writable buffer (the mapped file) */
    if (stamps_obj != Py_None && PyObject_GetBuffer(stamps_obj, &stamps, PyBUF_WRITABLE) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = NULL;
    Py_ssize_t *tied = NULL, *at = NULL;  /* the tied candidates; each candidate's cell */
    long long *counts = NULL;
    if (PyList_GET_SIZE(views) != n
        || (cells != Py_None && (stamps.obj == NULL || !PyList_CheckExact(cells) || PyList_GET_SIZE(cells) != n))) {
        PyErr_SetString(PyExc_ValueError, "views, cells: a list of one per candidate (cells with `stamps`)");
        goto done;
    }
    int noting = counts_at >= 0 && cells != Py_None;
    tied = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    counts = PyMem_Malloc((n ? n : 1) * sizeof(long long));
    if (tied == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t ntied = 0, nfound = 0;
    long long low = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long requests = 0;
        int found = 0;
        int step = count(PyList_GET_ITEM(ids, i), PyList_GET_ITEM(views, i), inflight, terms, now, &requests,
                         &counts[i], &found, NULL);
        if (step < 0) goto done;
        if (step == 0) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        nfound += found;
        if (ntied == 0 || requests < low) {
            low = requests;
            tied[0] = i;
            ntied = 1;
        } else if (requests == low) {
            tied[ntied++] = i;
        }
    }
    if (ntied == 0 || (noting && (nfound != n || PyDict_GET_SIZE(inflight) != n))) {
        out = Py_NewRef(Py_None);  /* no candidate, or counts of other instances to note: the Python's */
        goto done;
    }
    if (cells == Py_None) {
        if (ntied == 1) {
            out = PyLong_FromSsize_t(tied[0]);
        } else {
            out = PyList_New(ntied);
            for (Py_ssize_t k = 0; out != NULL && k < ntied; k++) {
                PyObject *index = PyLong_FromSsize_t(tied[k]);
                if (index == NULL) Py_CLEAR(out);
                else PyList_SET_ITEM(out, k, index);
            }
        }
        goto done;
    }
    /* the cells first (every one checked before anything is written), then the tie, then the counts */
    double *cell = (double *)stamps.buf;
    Py_ssize_t ncells = stamps.len / (Py_ssize_t)sizeof(double), pick = -1;
    at = PyMem_Malloc(n * sizeof(Py_ssize_t));
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t c = at[i] = PyLong_AsSsize_t(PyList_GET_ITEM(cells, i));
        if (c == -1 && PyErr_Occurred()) goto done;
        if (c < 0 || c >= ncells || (noting && (counts_at >= ncells || c >= ncells - counts_at))) {
            PyErr_SetString(PyExc_IndexError, "a cell beyond the stamps");
            goto done;
        }
    }
    double oldest = 0.0;
    for (Py_ssize_t k = 0; k < ntied; k++) {
        double v = cell[at[tied[k]]];
        if (pick < 0 || v < oldest) {
            oldest = v;
            pick = tied[k];
        }
    }
    if (noting)
        for (Py_ssize_t i = 0; i < n; i++) cell[at[i] + counts_at] = (double)counts[i];
    out = PyLong_FromSsize_t(pick);
done:
    if (stamps.obj != NULL) PyBuffer_Release(&stamps);
    PyMem_Free(tied);
    PyMem_Free(at);
    PyMem_Free(counts);
    return out;
}

PyDoc_STRVAR(counted_doc,
"counted(ids, views, inflight, now, terms) -> (dict, dict) | None\n\n"
"llm_policies._counted's two dicts of the candidates (as `least` takes them): instance_id ->\n"
"requests (ours + foreign, a float), and the same with the KV term of its terms added. None where\n"
"the Python must work them out (as `least`).");

static PyObject *counted(PyObject *self, PyObject *args) {
    PyObject *ids, *views, *inflight, *terms;
    double now;
    if (!PyArg_ParseTuple(args, "O!O!O!dO!", &PyList_Type, &ids, &PyList_Type, &views, &PyDict_Type, &inflight,
                          &now, &PyDict_Type, &terms))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (PyList_GET_SIZE(views) != n) {
        PyErr_SetString(PyExc_ValueError, "views: a list of one per candidate");
        return NULL;
    }
    PyObject *requests = PyDict_New(), *weighted = PyDict_New(), *out = NULL;
    if (requests == NULL || weighted == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long r = 0, ours = 0;
        int found = 0;
        double kv = 0.0;
        PyObject *iid = PyList_GET_ITEM(ids, i);
        int step = count(iid, PyList_GET_ITEM(views, i), inflight, terms, now, &r, &ours, &found, &kv);
        if (step < 0) goto done;
        if (step == 0) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *x = PyFloat_FromDouble((double)r), *y = PyFloat_FromDouble((double)r + kv);
        int bad = x == NULL || y == NULL || PyDict_SetItem(requests, iid, x) < 0
                  || PyDict_SetItem(weighted, iid, y) < 0;
        Py_XDECREF(x);
        Py_XDECREF(y);
        if (bad) goto done;
    }
    out = PyTuple_Pack(2, requests, weighted);
done:
    Py_XDECREF(requests);
    Py_XDECREF(weighted);
    return out;
}

static PyMethodDef methods[] = {
    {"least", least, METH_VARARGS, least_doc},
    {"counted", counted, METH_VARARGS, counted_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_least_requests",
    "The default's choice where no cache is at stake, compiled (llm_policies._least_requests).", -1, methods,
};

PyMODINIT_FUNC PyInit__least_requests(void) {
    if (!(s_latest = PyUnicode_InternFromString("latest"))
        || !(s_stale_after_s = PyUnicode_InternFromString("stale_after_s")))
        return NULL;
    return PyModule_Create(&module);
}
