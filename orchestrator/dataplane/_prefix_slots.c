/* The shared prefix index's slot reads and writes, compiled (dataplane/shared_prefix.py).

   Every routing decision of the default policy matches a prompt's chunk keys against the
   workers' shared table and records the chosen instance there: a dozen struct reads and
   writes per decision, ~1 us each in Python, more than half of a decision with long prompts
   (bench/decision_cost.py). Here they cost tens of nanoseconds. shared_prefix.py owns the
   file (create, open, the header, forgetting an instance) and the layout's numbers, which it
   hands to `Slots`; it keeps the same operations in Python for an install that could not build
   this module, and tests/test_prefix_slots.py holds both to the same bytes and answers.

   Slot layout (native byte order): key[16], holder times double[4], holder ids int32[4]
   (instance index + 1, 0: free). A key's probe starts at its first 8 bytes read little-endian.
   Other processes write the same memory without locks: every read here is a plain load of
   what is there now, as the Python version's struct reads are. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16
#define HOLDERS 4
#define SLOT_SIZE 64
#define TIMES_OFF KEY_BYTES
#define IDS_OFF (KEY_BYTES + 8 * HOLDERS)
#define STACK_POSITIONS 64

typedef struct {
    PyObject_HEAD
    Py_buffer view;      /* the mapped file, writable; released by release() */
    int held;
    Py_ssize_t slots_off, forgotten_off;
    uint64_t mask;
    int probe, max_instances;
    PyObject *names;     /* tuple: instance index -> its id as a str ("0", "1", ...) */
} Slots;

typedef struct {         /* one key's valid holders, in slot order, one entry per instance */
    int n;
    int idx[HOLDERS];
    double t[HOLDERS];
} Holders;

static uint64_t le64(const unsigned char *k) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | k[i];
    return v;
}

static double get_f64(const unsigned char *p) { double v; memcpy(&v, p, 8); return v; }
static int32_t get_i32(const unsigned char *p) { int32_t v; memcpy(&v, p, 4); return v; }
static void put_f64(unsigned char *p, double v) { memcpy(p, &v, 8); }
static void put_i32(unsigned char *p, int32_t v) { memcpy(p, &v, 4); }

static int is_empty(const unsigned char *key) {
    for (int i = 0; i < KEY_BYTES; i++)
        if (key[i]) return 0;
    return 1;
}

/* shared_prefix._key16: a 16-byte key as it is; a longer one cut, a shorter one padded with
   0x01; one with no non-zero byte (it would read as an empty slot) all 0x01. */
static int key16(PyObject *obj, unsigned char out[KEY_BYTES]) {
    char *buf;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(obj, &buf, &len) < 0) return -1;
    int nonzero = 0;
    for (Py_ssize_t i = 0; i < len && !nonzero; i++) nonzero = buf[i] != 0;
    if (!nonzero) {
        memset(out, 1, KEY_BYTES);
        return 0;
    }
    Py_ssize_t m = len < KEY_BYTES ? len : KEY_BYTES;
    memcpy(out, buf, m);
    memset(out + m, 1, KEY_BYTES - m);
    return 0;
}

static unsigned char *slot_at(Slots *s, uint64_t start, int probe) {
    return (unsigned char *)s->view.buf + s->slots_off + (Py_ssize_t)((start + (uint64_t)probe) & s->mask) * SLOT_SIZE;
}

static double forgotten(Slots *s, int idx) {
    return get_f64((unsigned char *)s->view.buf + s->forgotten_off + 8 * (Py_ssize_t)idx);
}

/* shared_prefix._holders: the key's holders routed at or after `oldest` and after their
   instance last lost its cache (none where the key is not stored). */
static void holders(Slots *s, const unsigned char *key, double oldest, Holders *out) {
    uint64_t start = le64(key);
    unsigned char *slot = NULL;
    out->n = 0;
    for (int probe = 0; probe < s->probe; probe++) {
        unsigned char *p = slot_at(s, start, probe);
        if (memcmp(p, key, KEY_BYTES) == 0) {
            slot = p;
            break;
        }
        if (is_empty(p)) return;  /* slots are never emptied: a key is never stored past one */
    }
    if (slot == NULL) return;
    for (int k = 0; k < HOLDERS; k++) {
        int32_t ident = get_i32(slot + IDS_OFF + 4 * k);
        if (ident <= 0) continue;
        double t = get_f64(slot + TIMES_OFF + 8 * k);
        int idx = ident - 1;
        if (!(t >= oldest && idx < s->max_instances && t > forgotten(s, idx))) continue;
        int j = 0;
        while (j < out->n && out->idx[j] != idx) j++;  /* a holder twice (racing writers): the later time */
        out->idx[j] = idx;
        out->t[j] = t;
        if (j == out->n) out->n++;
    }
}

static int holds(const Holders *h, int idx, double *t) {
    for (int j = 0; j < h->n; j++)
        if (h->idx[j] == idx) {
            if (t) *t = h->t[j];
            return 1;
        }
    return 0;
}

static int put_found(Slots *s, PyObject *found, int idx, Py_ssize_t depth, double t) {
    PyObject *value = Py_BuildValue("(nd)", depth, t);
    if (value == NULL) return -1;
    int rc = PyDict_SetItem(found, PyTuple_GET_ITEM(s->names, idx), value);
    Py_DECREF(value);
    return rc;
}

static int read_key(PyObject *keys, Py_ssize_t i, unsigned char out[KEY_BYTES]) {
    if (i < 0 || i >= PySequence_Fast_GET_SIZE(keys)) {  /* positions past the prompt: a caller's bug */
        PyErr_Format(PyExc_IndexError, "position %zd of %zd keys", i, PySequence_Fast_GET_SIZE(keys));
        return -1;
    }
    return key16(PySequence_Fast_GET_ITEM(keys, i), out);
}

/* The keys and their recorded positions as sequences read by index (new references). */
static int as_sequences(PyObject *keys_in, PyObject *positions_in, PyObject **keys, PyObject **positions) {
    *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (*keys == NULL) return -1;
    *positions = PySequence_Fast(positions_in, "positions must be a sequence");
    if (*positions == NULL) {
        Py_CLEAR(*keys);
        return -1;
    }
    return 0;
}

/* match_recency(keys, positions, oldest) -> (len(keys), {instance id: (depth, routed at)}):
   shared_prefix.SharedPrefixIndex.match_recency's bisection over the recorded positions. */
static PyObject *Slots_match_recency(Slots *s, PyObject *args) {
    PyObject *keys_in, *positions_in;
    double oldest;
    if (!s->held) return PyErr_Format(PyExc_ValueError, "the shared prefix index is closed");
    if (!PyArg_ParseTuple(args, "OOd", &keys_in, &positions_in, &oldest)) return NULL;
    PyObject *keys, *positions;
    if (as_sequences(keys_in, positions_in, &keys, &positions) < 0) return NULL;
    PyObject *found = PyDict_New(), *result = NULL;
    Holders stack_seen[STACK_POSITIONS], *seen = stack_seen;
    char stack_known[STACK_POSITIONS], *known = stack_known;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), npos = PySequence_Fast_GET_SIZE(positions);
    unsigned char key[KEY_BYTES];
    if (found == NULL) goto done;
    if (n == 0) {
        result = Py_BuildValue("(nO)", (Py_ssize_t)0, found);
        goto done;
    }
    if (npos > STACK_POSITIONS) {
        seen = PyMem_Malloc(npos * sizeof(Holders));
        known = PyMem_Malloc(npos);
        if (seen == NULL || known == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Holders first, last;
    if (read_key(keys, 0, key) < 0) goto done;
    holders(s, key, oldest, &first);
    if (first.n && n == 1) {
        for (int j = 0; j < first.n; j++)
            if (put_found(s, found, first.idx[j], 1, first.t[j]) < 0) goto done;
    } else if (first.n) {
        if (read_key(keys, n - 1, key) < 0) goto done;
        holders(s, key, oldest, &last);
        memset(known, 0, npos);
        for (int j = 0; j < first.n; j++) {
            int idx = first.idx[j];
            double t = 0.0;
            if (holds(&last, idx, &t)) {
                if (put_found(s, found, idx, n, t) < 0) goto done;
                continue;
            }
            if (!known[0]) {  /* slots read once for every instance's bisection */
                seen[0] = first;
                seen[npos - 1] = last;
                known[0] = known[npos - 1] = 1;
            }
            Py_ssize_t lo = 0, hi = npos - 1;  /* it holds position lo, not position hi (indices) */
            while (hi - lo > 1) {
                Py_ssize_t mid = (lo + hi) >> 1;
                if (!known[mid]) {
                    Py_ssize_t p = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(positions, mid));
                    if (p == -1 && PyErr_Occurred()) goto done;
                    if (read_key(keys, p, key) < 0) goto done;
                    holders(s, key, oldest, &seen[mid]);
                    known[mid] = 1;
                }
                if (holds(&seen[mid], idx, NULL)) lo = mid;
                else hi = mid;
            }
            Py_ssize_t p = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(positions, lo));
            if (p == -1 && PyErr_Occurred()) goto done;
            holds(&seen[lo], idx, &t);
            if (put_found(s, found, idx, p + 1, t) < 0) goto done;
        }
    }
    result = Py_BuildValue("(nO)", n, found);
done:
    if (seen != stack_seen) PyMem_Free(seen);
    if (known != stack_known) PyMem_Free(known);
    Py_XDECREF(found);
    Py_DECREF(keys);
    Py_DECREF(positions);
    return result;
}

/* shared_prefix._add_holder: instance `idx` was routed the key of `slot` now. */
static void add_holder(unsigned char *slot, int idx, double now) {
    int pos = -1;
    for (int k = 0; k < HOLDERS && pos < 0; k++)
        if (get_i32(slot + IDS_OFF + 4 * k) == idx + 1) pos = k;
    if (pos < 0) {  /* a free place (the first), or the holder used least recently */
        for (int k = 0; k < HOLDERS && pos < 0; k++)
            if (get_i32(slot + IDS_OFF + 4 * k) == 0) pos = k;
        if (pos < 0) {
            pos = 0;
            for (int k = 1; k < HOLDERS; k++)
                if (get_f64(slot + TIMES_OFF + 8 * k) < get_f64(slot + TIMES_OFF + 8 * pos)) pos = k;
        }
        put_i32(slot + IDS_OFF + 4 * pos, idx + 1);
    }
    put_f64(slot + TIMES_OFF + 8 * pos, now);
}

/* shared_prefix._record_one: the key where it is stored, else in a free slot of its
   neighbourhood, else in the one used least recently. */
static void record_one(Slots *s, const unsigned char *key, int idx, double now) {
    uint64_t start = le64(key);
    unsigned char *victim = NULL;
    double victim_age = 0.0;
    for (int probe = 0; probe < s->probe; probe++) {
        unsigned char *p = slot_at(s, start, probe);
        if (memcmp(p, key, KEY_BYTES) == 0) {
            add_holder(p, idx, now);
            return;
        }
        if (is_empty(p)) {
            victim = p;
            break;
        }
        double last_use = get_f64(p + TIMES_OFF);
        for (int k = 1; k < HOLDERS; k++) {
            double t = get_f64(p + TIMES_OFF + 8 * k);
            if (t > last_use) last_use = t;
        }
        if (victim == NULL || last_use < victim_age) {
            victim = p;
            victim_age = last_use;
        }
    }
    /* A new key: holders first (zeroed), then the key, so a reader never pairs the new key
       with the evicted key's holders. */
    put_f64(victim + TIMES_OFF, now);
    for (int k = 1; k < HOLDERS; k++) put_f64(victim + TIMES_OFF + 8 * k, 0.0);
    put_i32(victim + IDS_OFF, idx + 1);
    for (int k = 1; k < HOLDERS; k++) put_i32(victim + IDS_OFF + 4 * k, 0);
    memcpy(victim, key, KEY_BYTES);
}

/* record(keys, positions, idx, now): the keys at `positions` were routed to instance `idx` now. */
static PyObject *Slots_record(Slots *s, PyObject *args) {
    PyObject *keys_in, *positions_in;
    int idx;
    double now;
    if (!s->held) return PyErr_Format(PyExc_ValueError, "the shared prefix index is closed");
    if (!PyArg_ParseTuple(args, "OOid", &keys_in, &positions_in, &idx, &now)) return NULL;
    if (idx < 0 || idx >= s->max_instances)
        return PyErr_Format(PyExc_ValueError, "instance index %d: the index holds 0..%d", idx, s->max_instances - 1);
    PyObject *keys, *positions;
    if (as_sequences(keys_in, positions_in, &keys, &positions) < 0) return NULL;
    PyObject *result = NULL;
    Py_ssize_t npos = PySequence_Fast_GET_SIZE(positions);
    unsigned char key[KEY_BYTES];
    for (Py_ssize_t i = 0; i < npos; i++) {
        Py_ssize_t p = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(positions, i));
        if (p == -1 && PyErr_Occurred()) goto done;
        if (read_key(keys, p, key) < 0) goto done;
        unsigned char *first = slot_at(s, le64(key), 0);
        if (memcmp(first, key, KEY_BYTES) == 0) add_holder(first, idx, now);  /* the common case */
        else record_one(s, key, idx, now);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(keys);
    Py_DECREF(positions);
    return result;
}

static PyObject *Slots_release(Slots *s, PyObject *Py_UNUSED(ignored)) {
    if (s->held) {
        PyBuffer_Release(&s->view);
        s->held = 0;
    }
    Py_RETURN_NONE;
}

/* Slots(mapped, slots_off, slot_count, forgotten_off, probe, names, key_bytes, holders, slot_size):
   the last three are the layout shared_prefix.py defines, checked against this module's. */
static int Slots_init(Slots *s, PyObject *args, PyObject *kwds) {
    PyObject *mapped, *names;
    Py_ssize_t slots_off, slot_count, forgotten_off;
    int probe, key_bytes, holder_count, slot_size;
    if (!PyArg_ParseTuple(args, "OnnniO!iii", &mapped, &slots_off, &slot_count, &forgotten_off, &probe,
                          &PyTuple_Type, &names, &key_bytes, &holder_count, &slot_size))
        return -1;
    if (key_bytes != KEY_BYTES || holder_count != HOLDERS || slot_size != SLOT_SIZE) {
        PyErr_Format(PyExc_ValueError, "slot layout %d/%d/%d: this build has %d/%d/%d", key_bytes,
                     holder_count, slot_size, KEY_BYTES, HOLDERS, SLOT_SIZE);
        return -1;
    }
    if (slot_count <= 0 || (slot_count & (slot_count - 1)) || probe <= 0) {
        PyErr_Format(PyExc_ValueError, "slots=%zd, probe=%d: slots must be a power of two", slot_count, probe);
        return -1;
    }
    Slots_release(s, NULL);
    if (PyObject_GetBuffer(mapped, &s->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) return -1;
    s->held = 1;
    Py_ssize_t max_instances = PyTuple_GET_SIZE(names);
    if (s->view.len < slots_off + slot_count * SLOT_SIZE || s->view.len < forgotten_off + 8 * max_instances) {
        Slots_release(s, NULL);
        PyErr_Format(PyExc_ValueError, "a mapping of %zd bytes is too short for its slots", s->view.len);
        return -1;
    }
    s->slots_off = slots_off;
    s->forgotten_off = forgotten_off;
    s->mask = (uint64_t)slot_count - 1;
    s->probe = probe;
    s->max_instances = (int)max_instances;
    Py_XSETREF(s->names, Py_NewRef(names));
    return 0;
}

static void Slots_dealloc(Slots *s) {
    Slots_release(s, NULL);
    Py_XDECREF(s->names);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef Slots_methods[] = {
    {"match_recency", (PyCFunction)Slots_match_recency, METH_VARARGS,
     "match_recency(keys, positions, oldest) -> (n, {instance id: (depth, routed at)})"},
    {"record", (PyCFunction)Slots_record, METH_VARARGS,
     "record(keys, positions, instance index, now): the keys at positions routed there now"},
    {"release", (PyCFunction)Slots_release, METH_NOARGS, "let the mapping go (before it is closed)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "orchestrator.dataplane._prefix_slots.Slots",
    .tp_basicsize = sizeof(Slots),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The shared prefix index's slots, read and written in place.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slots_init,
    .tp_dealloc = (destructor)Slots_dealloc,
    .tp_methods = Slots_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_slots", "The shared prefix index's slots, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__prefix_slots(void) {
    if (PyType_Ready(&SlotsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Slots", (PyObject *)&SlotsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
