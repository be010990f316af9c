/* Column sums and cell reads and writes of the data plane's shared files, compiled (shared_cells.py).

   Every routing decision reads the in-flight count of each candidate instance summed over the
   worker rows in use (shared_table.py), cost-model also the other workers' pending prefill
   (shared_pending.py), and the default writes each count it read to the turns file and, where
   instances tie, reads their stamps there (shared_stamps.py). In Python those are struct
   unpacks added lane by lane and a store or a look-up per instance: 2.8, 3.6 and 1.4 us at 16
   instances and 4 worker rows on the 2-core box, and 4.0 us for a tie of 16, where the default's
   whole decision took ~17 us. Here each is one pass over the cells (0.8, 1.4, 0.6 and 1.8 us
   with the calls, the lists and the dicts). A cost-model choice also reads, for each instance
   holding the prompt's prefix and for the one chosen, every worker's routed blocks and requests
   there (journal.WriteLog): two columns of two files, here one pass (`pair_sums`, which also adds
   the worker's own routing first where asked), and for each holder what was routed there since
   the prefix was (`routed_since`: those totals less the log's notes at that time, interpolated;
   4.8 us a holder in Python, 2.4 with it). The callers own the files and their layouts and
   keep the same operations in Python for an install that could not build this module;
   tests/test_shared_cells.py holds both to the same answers and bytes.

   Other processes write the same memory without locks: every read is a plain load of what is
   there now, as the Python version's struct reads are. Sums run in row order from 0, as the
   Python adds them, so float sums match to the bit. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

/* The cells [offset + r * stride + k * size] for r < rows, k < width, must lie in the buffer. */
static int in_bounds(const Py_buffer *view, Py_ssize_t offset, Py_ssize_t stride, Py_ssize_t rows,
                     Py_ssize_t width, Py_ssize_t size) {
    if (offset < 0 || stride < 0 || rows < 0 || width < 0) return 0;
    if (rows == 0 || width == 0) return 1;
    if (width > (PY_SSIZE_T_MAX - offset) / size) return 0;
    if (rows - 1 > (PY_SSIZE_T_MAX - offset - width * size) / (stride ? stride : 1)) return 0;
    return offset + (rows - 1) * stride + width * size <= view->len;
}

PyDoc_STRVAR(column_sums_doc,
"column_sums(buffer, offset, stride, rows, width, kind, skip, keys=None) -> list | dict\n\n"
"For k < width, the sum over rows r < rows but `skip` (-1: none) of the cell at\n"
"offset + r * stride + k * size, native byte order: kind 'i' int32 cells (ints),\n"
"'d' float64 cells (floats). With `keys` (a list of width keys), a dict of keys[k] -> the\n"
"k-th sum instead of the list. IndexError where a cell lies beyond the buffer.");

static PyObject *column_sums(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset, stride, rows, width, skip;
    int kind;
    PyObject *keys = Py_None;
    if (!PyArg_ParseTuple(args, "y*nnnnCn|O", &view, &offset, &stride, &rows, &width, &kind, &skip, &keys))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t size = kind == 'i' ? 4 : kind == 'd' ? 8 : 0;
    if (!size) {
        PyErr_Format(PyExc_ValueError, "kind=%c: must be 'i' or 'd'", kind);
        goto done;
    }
    if (keys != Py_None && (!PyList_Check(keys) || PyList_GET_SIZE(keys) != width)) {
        PyErr_SetString(PyExc_ValueError, "keys: must be a list of `width` keys");
        goto done;
    }
    if (!in_bounds(&view, offset, stride, rows, width, size)) {
        PyErr_SetString(PyExc_IndexError, "cells beyond the buffer");
        goto done;
    }
    out = keys == Py_None ? PyList_New(width) : PyDict_New();
    if (out == NULL) goto done;
    const unsigned char *base = (const unsigned char *)view.buf + offset;
    for (Py_ssize_t k = 0; k < width; k++) {
        PyObject *item;
        if (kind == 'i') {
            long long sum = 0;
            for (Py_ssize_t r = 0; r < rows; r++) {
                int32_t v;
                if (r == skip) continue;
                memcpy(&v, base + r * stride + k * 4, 4);
                sum += v;
            }
            item = PyLong_FromLongLong(sum);
        } else {
            double sum = 0.0;  /* 0.0 + the first row is that row (cells are never -0.0: they start at 0.0) */
            for (Py_ssize_t r = 0; r < rows; r++) {
                double v;
                if (r == skip) continue;
                memcpy(&v, base + r * stride + k * 8, 8);
                sum += v;
            }
            item = PyFloat_FromDouble(sum);
        }
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        if (keys == Py_None) {
            PyList_SET_ITEM(out, k, item);
        } else {
            int failed = PyDict_SetItem(out, PyList_GET_ITEM(keys, k), item);
            Py_DECREF(item);
            if (failed) {
                Py_CLEAR(out);
                goto done;
            }
        }
    }
done:
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(put_cells_doc,
"put_cells(buffer, add, cells, values) -> list\n\n"
"For each (id, number) of the dict `values` whose id the dict `cells` maps to a float64 cell\n"
"index c, writes the number as float64 at cell c + add. Returns the ids `cells` lacks, not\n"
"written (the caller works their cells out and writes them). IndexError where a cell lies\n"
"beyond the buffer (the cells before it are written).");

static PyObject *put_cells(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t add;
    PyObject *cells, *values;
    if (!PyArg_ParseTuple(args, "w*nO!O!", &view, &add, &PyDict_Type, &cells, &PyDict_Type, &values))
        return NULL;
    PyObject *missing = PyList_New(0);
    if (missing == NULL) goto done;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(values, &pos, &key, &value)) {
        PyObject *cell = PyDict_GetItemWithError(cells, key);
        if (cell == NULL) {
            if (PyErr_Occurred() || PyList_Append(missing, key) < 0) goto fail;
            continue;
        }
        Py_ssize_t c = PyLong_AsSsize_t(cell);
        if (c == -1 && PyErr_Occurred()) goto fail;
        double v = PyFloat_AsDouble(value);
        if (v == -1.0 && PyErr_Occurred()) goto fail;
        Py_ssize_t at = c + add;
        if (at < 0 || at > view.len / 8 - 1) {
            PyErr_SetString(PyExc_IndexError, "cell beyond the buffer");
            goto fail;
        }
        memcpy((unsigned char *)view.buf + 8 * at, &v, 8);
    }
    goto done;
fail:
    Py_CLEAR(missing);
done:
    PyBuffer_Release(&view);
    return missing;
}

PyDoc_STRVAR(read_cells_doc,
"read_cells(buffer, cells, ids) -> list\n\n"
"For each id of the list `ids`, the float64 at the cell index the dict `cells` maps it to, or\n"
"None where `cells` lacks it (the caller works its cell out). IndexError where a cell lies\n"
"beyond the buffer.");

static PyObject *read_cells(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *cells, *ids;
    if (!PyArg_ParseTuple(args, "y*O!O!", &view, &PyDict_Type, &cells, &PyList_Type, &ids))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item, *cell = PyDict_GetItemWithError(cells, PyList_GET_ITEM(ids, k));
        if (cell == NULL) {
            if (PyErr_Occurred()) goto fail;
            Py_INCREF(Py_None);
            item = Py_None;
        } else {
            Py_ssize_t c = PyLong_AsSsize_t(cell);
            double v;
            if (c == -1 && PyErr_Occurred()) goto fail;
            if (c < 0 || c > view.len / 8 - 1) {
                PyErr_SetString(PyExc_IndexError, "cell beyond the buffer");
                goto fail;
            }
            memcpy(&v, (const unsigned char *)view.buf + 8 * c, 8);
            item = PyFloat_FromDouble(v);
            if (item == NULL) goto fail;
        }
        PyList_SET_ITEM(out, k, item);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

/* The float64 cells at base_a + r * stride and base_b + r * stride summed over r < rows, in row order
   from 0, as Python's sum() of the column (so the floats match to the bit). */
static void column_pair(const unsigned char *base_a, const unsigned char *base_b, Py_ssize_t stride, Py_ssize_t rows,
                        double *sum_a, double *sum_b) {
    double a = 0.0, b = 0.0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        double v;
        memcpy(&v, base_a + r * stride, 8);
        a += v;
        memcpy(&v, base_b + r * stride, 8);
        b += v;
    }
    *sum_a = a;
    *sum_b = b;
}

PyDoc_STRVAR(pair_sums_doc,
"pair_sums(a, b, offset, stride, rows, own=-1, add_a=0.0, add_b=0.0) -> (float, float)\n\n"
"The sums over rows r < rows of the float64 cell at offset + r * stride, in buffer `a` and in\n"
"buffer `b` (two files of one layout: a worker's routed blocks and requests, read together per\n"
"instance by each cost-model choice). With `own` >= 0 (the worker's row), add_a and add_b are\n"
"first added to that row's cells (the worker's routing, then summed with the others: its row is\n"
"among them where it is one of the rows in use). IndexError where a cell lies beyond either buffer.");

static PyObject *pair_sums(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t offset, stride, rows, own = -1;
    double add_a = 0.0, add_b = 0.0;
    if (!PyArg_ParseTuple(args, "w*w*nnn|ndd", &a, &b, &offset, &stride, &rows, &own, &add_a, &add_b)) return NULL;
    PyObject *out = NULL;
    if (!in_bounds(&a, offset, stride, rows, 1, 8) || !in_bounds(&b, offset, stride, rows, 1, 8)
        || (own >= 0
            && (!in_bounds(&a, offset, stride, own + 1, 1, 8) || !in_bounds(&b, offset, stride, own + 1, 1, 8)))) {
        PyErr_SetString(PyExc_IndexError, "cells beyond the buffer");
        goto done;
    }
    unsigned char *base_a = (unsigned char *)a.buf + offset, *base_b = (unsigned char *)b.buf + offset;
    if (own >= 0) {  /* a plain load and store of the worker's own cells, as the Python's += */
        double v;
        memcpy(&v, base_a + own * stride, 8);
        v += add_a;
        memcpy(base_a + own * stride, &v, 8);
        memcpy(&v, base_b + own * stride, 8);
        v += add_b;
        memcpy(base_b + own * stride, &v, 8);
    }
    double sum_a, sum_b;
    column_pair(base_a, base_b, stride, rows, &sum_a, &sum_b);
    out = Py_BuildValue("(dd)", sum_a, sum_b);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return out;
}

/* A note array of the write log as `kind` ('d' doubles, 'q' 64-bit ints), n items; 0 where it is not
   one (the Python reads it), -1 on an error. */
static int note_array(PyObject *obj, Py_buffer *view, char kind) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize != 8 || view->format == NULL || view->format[0] != kind || view->format[1] != '\0') {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(routed_since_doc,
"routed_since(a, b, offset, stride, rows, at, blocks, requests, start, trimmed, t) -> (float, int) | None\n\n"
"journal.WriteLog.since with every worker's totals: pair_sums(a, b, offset, stride, rows) now less\n"
"the totals noted at time t (at, blocks: arrays of doubles, requests: of 64-bit ints, one note per\n"
"index from `start` on, times ascending), interpolated between the notes around t; before the\n"
"first note, (inf, requests now) where `trimmed`, else the first note's. The Python's operations\n"
"on the same doubles, in its order. None where the notes are not such arrays of one length, there\n"
"is no note, or a total is not finite (the Python's to work out). IndexError as pair_sums'.");

static PyObject *routed_since(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t offset, stride, rows, start;
    PyObject *at_obj, *blocks_obj, *requests_obj;
    int trimmed;
    double t;
    if (!PyArg_ParseTuple(args, "y*y*nnnOOOnpd", &a, &b, &offset, &stride, &rows, &at_obj, &blocks_obj,
                          &requests_obj, &start, &trimmed, &t))
        return NULL;
    PyObject *out = NULL;
    Py_buffer at = {0}, bl = {0}, rq = {0};
    int have = 0;  /* how many of the three arrays are held */
    if (!in_bounds(&a, offset, stride, rows, 1, 8) || !in_bounds(&b, offset, stride, rows, 1, 8)) {
        PyErr_SetString(PyExc_IndexError, "cells beyond the buffer");
        goto done;
    }
    if (note_array(at_obj, &at, 'd') != 1) goto plain;
    have = 1;
    if (note_array(blocks_obj, &bl, 'd') != 1) goto plain;
    have = 2;
    if (note_array(requests_obj, &rq, 'q') != 1) goto plain;
    have = 3;
    Py_ssize_t n = at.len / 8;
    if (bl.len / 8 != n || rq.len / 8 != n || start < 0 || start >= n) goto plain;
    const double *ts = at.buf, *bs = bl.buf;
    const int64_t *rs = rq.buf;
    double sum_a, sum_b;  /* pair_sums' */
    column_pair((const unsigned char *)a.buf + offset, (const unsigned char *)b.buf + offset, stride, rows, &sum_a,
                &sum_b);
    /* int(total_requests): truncated toward zero; beyond what a long long holds, the Python's */
    if (!(sum_b > -9.2e18 && sum_b < 9.2e18) || !isfinite(sum_a)) goto plain;
    long long requests = (long long)sum_b;
    /* bisect_right(at, t, start), as CPython's: lo moves past every item t is not less than */
    Py_ssize_t lo = start, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t < ts[mid]) hi = mid;
        else lo = mid + 1;
    }
    double then_b;
    long long left_r;
    if (lo == start || lo == n) {
        if (lo == start && trimmed) {
            out = Py_BuildValue("(dL)", INFINITY, requests);
            goto done;
        }
        Py_ssize_t k = lo == start ? start : n - 1;
        then_b = bs[k];
        left_r = requests - (long long)rs[k];  /* ints: exact, as the Python's */
    } else {
        double t0 = ts[lo - 1], t1 = ts[lo];
        double f = t1 > t0 ? (t - t0) / (t1 - t0) : 1.0;
        then_b = bs[lo - 1] + f * (bs[lo] - bs[lo - 1]);
        double then_r = (double)rs[lo - 1] + f * (double)(rs[lo] - rs[lo - 1]);
        double left = (double)requests - then_r;
        if (!(left > -9.2e18 && left < 9.2e18)) goto plain;
        left_r = (long long)left;  /* int(): toward zero */
    }
    double left_b = sum_a - then_b;
    out = Py_BuildValue("(dL)", left_b > 0.0 ? left_b : 0.0, left_r > 0 ? left_r : 0LL);
    goto done;
plain:
    if (!PyErr_Occurred()) out = Py_NewRef(Py_None);
done:
    if (have > 0) PyBuffer_Release(&at);
    if (have > 1) PyBuffer_Release(&bl);
    if (have > 2) PyBuffer_Release(&rq);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"column_sums", column_sums, METH_VARARGS, column_sums_doc},
    {"put_cells", put_cells, METH_VARARGS, put_cells_doc},
    {"read_cells", read_cells, METH_VARARGS, read_cells_doc},
    {"pair_sums", pair_sums, METH_VARARGS, pair_sums_doc},
    {"routed_since", routed_since, METH_VARARGS, routed_since_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shared_cells", "The data plane's shared cells: column sums and writes, compiled.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shared_cells(void) { return PyModule_Create(&module); }
