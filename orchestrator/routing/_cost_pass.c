/* The cost-model's pass over its candidates, compiled: cost_policy._price.

   A cost-model choice prices every candidate: its requests, the prompt tokens pending prefill
   there, the prefill this prompt needs there, the wait for a slot, what the choice costs the
   others. In Python that pass was the largest part of a choice at 16 instances (about 20
   interpreted lines a candidate); here it is one pass over the candidates' attributes. It is
   the same pass: the same operations on the same doubles in the same order, so the same costs to
   the bit; an entry of a pending ledger that is due is dropped by the ledger's own `at` (Python),
   and every case that is not the plain one (counts not in a dict, a count that is not an int, a
   value that is not a number, a ledger's heap that is not a list) is left to the Python (None), so the Python keeps
   every rule and this module none of its own. tests/test_cost_policy.py holds both to the same
   answers on random states. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_numbers.h"
#include <math.h>
#include <structmember.h>

/* Where the candidates' and their ledgers' attributes live: `_Inst` and `Pending` keep them in
   __slots__, so each is a pointer at a fixed offset of the object, read here without a look-up
   (PyObject_GetAttr through the type and the slot's descriptor: about 50 ns each on the 2-core
   box, 12 a candidate, two thirds of this pass at 16 candidates). Worked out once per type from
   its member descriptors; an object of another type, or an attribute that is not a plain slot,
   goes through PyObject_GetAttr as before. */
enum { A_IID, A_AT, A_STALE_AFTER_S, A_RATES, A_FOREIGN, A_PREFILL_S, A_DECODE_S, A_SLOTS, A_WAIT_UNIT, A_PENDING,
       A_HEAP, A_TOTAL, A_COUNT };
static PyObject *names[A_COUNT];

typedef struct Layout {
    PyTypeObject *type;  /* a strong reference: its address is not reused while cached */
    Py_ssize_t offset[A_COUNT];  /* -1: not a plain slot of this type */
} Layout;

static Layout inst_layout, pending_layout;

static int layout_of(Layout *layout, PyTypeObject *type, int first, int last) {
    if (layout->type == type) return 0;
    Py_XDECREF(layout->type);
    layout->type = (PyTypeObject *)Py_NewRef(type);
    for (int a = first; a <= last; a++) {
        layout->offset[a] = -1;
        /* the class's attribute: for a slot, its member descriptor */
        PyObject *descr = PyObject_GetAttr((PyObject *)type, names[a]);
        if (descr == NULL) {
            PyErr_Clear();  /* not a class attribute: read through PyObject_GetAttr, which says why */
            continue;
        }
        if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == T_OBJECT_EX && !(member->flags & READONLY)) layout->offset[a] = member->offset;
        }
        Py_DECREF(descr);
    }
    return 0;
}

/* obj.<names[a]>: a new reference, or NULL with an exception set. */
static PyObject *get(PyObject *obj, const Layout *layout, int a) {
    if (Py_TYPE(obj) == layout->type && layout->offset[a] >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + layout->offset[a]);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, names[a]);
}

/* obj.<names[a]> as a double (float_value) or an int (int_value): 1; 0 where it is not one. */
static int attr_float(PyObject *obj, const struct Layout *layout, int a, double *out) {
    PyObject *v = get(obj, layout, a);
    if (v == NULL) return -1;
    int ok = float_value(v, out);
    Py_DECREF(v);
    return ok;
}

static int attr_int(PyObject *obj, const struct Layout *layout, int a, long long *out) {
    PyObject *v = get(obj, layout, a);
    if (v == NULL) return -1;
    int ok = int_value(v, out);
    Py_DECREF(v);
    return ok;
}

/* dict[key] as an int (missing: 0): 1; 0 where the value is not an exact int; -1 on an error. */
static int item_int(PyObject *dict, PyObject *key, long long *out) {
    PyObject *v = PyDict_GetItemWithError(dict, key);  /* borrowed, read at once */
    if (v == NULL) {
        *out = 0;
        return PyErr_Occurred() ? -1 : 1;
    }
    return int_value(v, out);
}

/* The prompt tokens pending prefill in the candidate's own ledger (`pending`), as
   `pending.total if heap[0][0] > now else pending.at(now)) if heap else 0.0`. */
static int queued_of(PyObject *pending, double now, double *out) {
    PyObject *heap = get(pending, &pending_layout, A_HEAP);
    if (heap == NULL) return -1;
    int ok = 0;
    if (!PyList_CheckExact(heap)) goto done;
    if (PyList_GET_SIZE(heap) == 0) {
        *out = 0.0;
        ok = 1;
        goto done;
    }
    PyObject *entry = PyList_GET_ITEM(heap, 0);
    double until;
    if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) < 1) goto done;
    if ((ok = float_value(PyList_GET_ITEM(entry, 0), &until)) != 1) goto done;
    if (until > now) {
        ok = attr_float(pending, &pending_layout, A_TOTAL, out);
        goto done;
    }
    PyObject *when = PyFloat_FromDouble(now);
    PyObject *total = when == NULL ? NULL : PyObject_CallMethodOneArg(pending, names[A_AT], when);
    Py_XDECREF(when);
    if (total == NULL) {
        ok = -1;
        goto done;
    }
    ok = float_value(total, out);
    Py_DECREF(total);
done:
    Py_DECREF(heap);
    return ok;
}

PyDoc_STRVAR(price_doc,
"price(cands, inflight, tokens, cached, least, others, now, calibrated) -> (fresh, priced) | None\n\n"
"cost_policy._price, compiled: the same answer, or None where the Python must work it out (counts,\n"
"cached tokens or the others' prefill not in a dict, a count that is not an int, a value that is\n"
"not a number).");

static PyObject *price(PyObject *self, PyObject *args) {
    PyObject *cands, *inflight, *cached, *others;
    long long tokens, least;
    double now;
    int calibrated;
    if (!PyArg_ParseTuple(args, "O!OLOLOdp", &PyList_Type, &cands, &inflight, &tokens, &cached, &least, &others,
                          &now, &calibrated))
        return NULL;
    /* counts, cached tokens and the others' prefill in plain dicts (a Mapping of another kind: the Python's) */
    if (!PyDict_CheckExact(inflight) || !PyDict_CheckExact(cached) || (others != Py_None && !PyDict_CheckExact(others)))
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(cands);
    PyObject *out = NULL, *costs = NULL, *ns = NULL;
    int fresh = 1, rated = calibrated, ok;
    /* the candidates' snapshots and rates: in a first pass, as each count below depends on
       whether every snapshot is fresh */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *inst = PyList_GET_ITEM(cands, i);
        double at, stale_after;
        layout_of(&inst_layout, Py_TYPE(inst), A_IID, A_PENDING);
        if ((ok = attr_float(inst, &inst_layout, A_AT, &at)) != 1
            || (ok = attr_float(inst, &inst_layout, A_STALE_AFTER_S, &stale_after)) != 1)
            goto plain;
        if (now - at > stale_after) fresh = 0;
        PyObject *rates = get(inst, &inst_layout, A_RATES);
        if (rates == NULL) return NULL;
        if (rates == Py_None) rated = 0;
        Py_DECREF(rates);
    }
    if (!rated) return Py_BuildValue("(OO)", fresh ? Py_True : Py_False, Py_None);
    if (!(costs = PyList_New(count)) || !(ns = PyList_New(count))) goto done;
    double copy_low = INFINITY, copy_buy = 0.0, low = INFINITY, tol = INFINITY;
    Py_ssize_t copy_at = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *inst = PyList_GET_ITEM(cands, i);
        PyObject *iid = get(inst, &inst_layout, A_IID);
        if (iid == NULL) goto done;
        long long n, foreign = 0, slots, got;
        double p, decode_s, wait_unit, queued, other = 0.0;
        ok = item_int(inflight, iid, &n);
        if (ok == 1 && fresh) ok = attr_int(inst, &inst_layout, A_FOREIGN, &foreign);
        if (ok == 1) ok = attr_float(inst, &inst_layout, A_PREFILL_S, &p);
        if (ok == 1) ok = attr_float(inst, &inst_layout, A_DECODE_S, &decode_s);
        if (ok == 1) ok = attr_int(inst, &inst_layout, A_SLOTS, &slots);
        if (ok == 1) ok = attr_float(inst, &inst_layout, A_WAIT_UNIT, &wait_unit);
        if (ok == 1) ok = item_int(cached, iid, &got);  /* none cached there: 0, all of it to compute */
        if (ok == 1 && others != Py_None) {
            PyObject *v = PyDict_GetItemWithError(others, iid);
            ok = v != NULL ? float_value(v, &other) : (PyErr_Occurred() ? -1 : 1);
        }
        Py_DECREF(iid);
        if (ok == 1) {
            PyObject *pending = get(inst, &inst_layout, A_PENDING);
            if (pending == NULL) goto done;
            layout_of(&pending_layout, Py_TYPE(pending), A_HEAP, A_TOTAL);
            ok = queued_of(pending, now, &queued);
            Py_DECREF(pending);
        }
        if (ok != 1) goto plain;
        n += foreign;
        long long uncached = tokens - got;
        if (others != Py_None) queued += other;
        double cost = p * (queued + (double)uncached) + decode_s;
        if (n >= slots) cost += (double)(n - slots + 1) * wait_unit;
        if (uncached > least) {
            double over = p * (double)(uncached - least) * (double)(n >= slots ? n - slots + 1 : 1);
            cost += over;
            double buy = over + p * (double)(uncached - least);
            if (cost - buy < copy_low) {
                copy_low = cost - buy;
                copy_at = i;
                copy_buy = buy;
            }
        }
        PyObject *c = PyFloat_FromDouble(cost), *k = PyLong_FromLongLong(n);
        if (c == NULL || k == NULL) {
            Py_XDECREF(c);
            Py_XDECREF(k);
            goto done;
        }
        PyList_SET_ITEM(costs, i, c);
        PyList_SET_ITEM(ns, i, k);
        if (cost < low) low = cost;
        if (decode_s < tol) tol = decode_s;
    }
    out = Py_BuildValue("(O(OOdddnd))", fresh ? Py_True : Py_False, costs, ns, low, tol, copy_low, copy_at,
                        copy_buy);
    goto done;
plain:
    if (ok == 0) out = Py_NewRef(Py_None);
done:
    Py_XDECREF(costs);
    Py_XDECREF(ns);
    return out;
}

static PyMethodDef methods[] = {
    {"price", price, METH_VARARGS, price_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cost_pass", "The cost-model's pass over its candidates, compiled (cost_policy._price).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__cost_pass(void) {
    static const char *const spelled[A_COUNT] = {"iid", "at", "stale_after_s", "rates", "foreign", "prefill_s",
                                                  "decode_s", "slots", "wait_unit", "pending", "heap", "total"};
    for (int a = 0; a < A_COUNT; a++)
        if (!(names[a] = PyUnicode_InternFromString(spelled[a]))) return NULL;
    return PyModule_Create(&module);
}
