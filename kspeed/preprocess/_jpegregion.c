/* Decoding one region of a JPEG image with libjpeg-turbo, for kspeed.preprocess.jpeg_region.
 *
 * header(data) -> (height, width, components, color_space)
 * decode(data, top, left, height, width, denom) -> (pixels, rows, columns, first_column)
 *
 * decode() decodes the image scaled by 1/denom (denom 1, 2, 4 or 8: libjpeg-turbo's SIMD scaled
 * IDCTs) and only the rows top..top+height and the columns around left..left+width of that scaled
 * image: rows above the region are skipped (jpeg_skip_scanlines: entropy-decoded, not transformed),
 * the decode stops after its last row (the rest is never read), and columns outside it are not
 * transformed (jpeg_crop_scanline, which widens the column range to whole iMCUs: first_column and
 * columns say what was kept). pixels is a bytearray of rows x columns RGB triplets.
 *
 * Settings are libjpeg's defaults (integer "islow" IDCT, fancy upsampling), so the same bytes
 * decode to the same pixels on every host with the same libjpeg-turbo. Any libjpeg error or
 * warning (corrupt or truncated data, an unsupported color space) raises ValueError with
 * libjpeg's message; nothing is decoded partly. The GIL is released while libjpeg works.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} Errors;

static void fail(j_common_ptr cinfo) {
    Errors *errors = (Errors *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, errors->message);
    longjmp(errors->jump, 1);
}

static void warn(j_common_ptr cinfo, int level) {
    if (level < 0) { /* corrupt data: libjpeg would go on with grey or garbage pixels */
        fail(cinfo);
    }
}

static void setup(struct jpeg_decompress_struct *cinfo, Errors *errors) {
    memset(cinfo, 0, sizeof(*cinfo));
    memset(errors, 0, sizeof(*errors));
    cinfo->err = jpeg_std_error(&errors->pub);
    errors->pub.error_exit = fail;
    errors->pub.emit_message = warn;
}

static PyObject *header(PyObject *module, PyObject *arg) {
    Py_buffer view;
    struct jpeg_decompress_struct cinfo;
    Errors errors;
    PyObject *result;

    (void)module;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    setup(&cinfo, &errors);
    if (setjmp(errors.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "cannot read the JPEG header: %s", errors.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)view.buf, (unsigned long)view.len);
    jpeg_read_header(&cinfo, TRUE);
    result = Py_BuildValue("(IIii)", cinfo.image_height, cinfo.image_width, cinfo.num_components,
                           (int)cinfo.jpeg_color_space);
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *decode(PyObject *module, PyObject *args) {
    Py_buffer view;
    unsigned int top, left, height, width, denom;
    struct jpeg_decompress_struct cinfo;
    Errors errors;
    PyThreadState *volatile released = NULL;
    PyObject *volatile pixels = NULL;
    JDIMENSION first_column, columns, done;
    size_t stride;
    unsigned char *base;

    (void)module;
    if (!PyArg_ParseTuple(args, "y*IIIII:decode", &view, &top, &left, &height, &width, &denom)) {
        return NULL;
    }
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "scale denominator %u is not 1, 2, 4 or 8", denom);
        return NULL;
    }
    if (height == 0 || width == 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "empty region %ux%u", height, width);
        return NULL;
    }
    setup(&cinfo, &errors);
    if (setjmp(errors.jump)) {
        if (released != NULL) {
            PyEval_RestoreThread(released);
        }
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        Py_XDECREF(pixels);
        PyErr_Format(PyExc_ValueError, "cannot decode the JPEG region: %s", errors.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)view.buf, (unsigned long)view.len);
    released = PyEval_SaveThread();
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_RGB &&
        cinfo.jpeg_color_space != JCS_GRAYSCALE) {
        snprintf(errors.message, sizeof(errors.message), "color space %d has no RGB conversion here",
                 (int)cinfo.jpeg_color_space);
        longjmp(errors.jump, 1);
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    jpeg_start_decompress(&cinfo);
    if (top >= cinfo.output_height || height > cinfo.output_height - top || left >= cinfo.output_width ||
        width > cinfo.output_width - left) {
        snprintf(errors.message, sizeof(errors.message),
                 "region %ux%u at (%u, %u) is outside the %ux%u image scaled by 1/%u", height, width, top, left,
                 cinfo.output_height, cinfo.output_width, denom);
        longjmp(errors.jump, 1);
    }
    first_column = left;
    columns = width;
    jpeg_crop_scanline(&cinfo, &first_column, &columns);
    PyEval_RestoreThread(released);
    released = NULL;
    stride = (size_t)columns * 3;
    pixels = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(stride * height));
    if (pixels == NULL) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&view);
        return NULL;
    }
    base = (unsigned char *)PyByteArray_AS_STRING(pixels);
    released = PyEval_SaveThread();
    if (top > 0 && jpeg_skip_scanlines(&cinfo, top) != top) {
        snprintf(errors.message, sizeof(errors.message), "could not skip %u rows", top);
        longjmp(errors.jump, 1);
    }
    for (done = 0; done < height;) {
        JSAMPROW rows[16];
        JDIMENSION want = height - done < 16 ? height - done : 16;
        JDIMENSION k;
        for (k = 0; k < want; k++) {
            rows[k] = base + (size_t)(done + k) * stride;
        }
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            snprintf(errors.message, sizeof(errors.message), "no row after %u of %u", done, height);
            longjmp(errors.jump, 1);
        }
        done += got;
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the region are never decoded */
    jpeg_destroy_decompress(&cinfo);
    PyEval_RestoreThread(released);
    released = NULL;
    PyBuffer_Release(&view);
    return Py_BuildValue("(NIII)", pixels, height, (unsigned int)columns, (unsigned int)first_column);
}

static PyMethodDef methods[] = {
    {"header", header, METH_O, "header(data) -> (height, width, components, color_space)"},
    {"decode", decode, METH_VARARGS,
     "decode(data, top, left, height, width, denom) -> (pixels, rows, columns, first_column)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_jpegregion", "Decoding one region of a JPEG image with libjpeg-turbo.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpegregion(void) {
    PyObject *module = PyModule_Create(&definition);
    if (module == NULL) {
        return NULL;
    }
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
    if (PyModule_AddIntConstant(module, "LIBJPEG_TURBO_VERSION_NUMBER", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    if (PyModule_AddIntConstant(module, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
