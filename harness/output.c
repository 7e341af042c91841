/* SPDX-License-Identifier: Apache-2.0 */
/* Output files: checked before a run starts (never onto an input, never through a link) and written atomically
 * (a temporary file beside the target, flushed, then renamed over it), so a failed write never leaves a truncated
 * file where the previous one was. */
#include "output.h"

#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"

/* The folder of path ("." for a bare name) into buf. */
static void folder_of(const char *path, char *buf, size_t size)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(buf, size, ".");
    else if (slash == path)
        snprintf(buf, size, "/");
    else
        snprintf(buf, size, "%.*s", (int)(slash - path), path);
}

moert_result moert_output_check(const char *what, const char *path, const char *const *inputs, int ninputs)
{
    struct stat st;
    char folder[PATH_MAX];
    if (!path || !path[0]) return moert_set_last_error(MOERT_ERR_IO, "%s: an empty path", what);
    if (lstat(path, &st) == 0) {
        if (S_ISLNK(st.st_mode))
            return moert_set_last_error(MOERT_ERR_IO,
                                        "%s %s is a symbolic link: moert writes outputs only to plain files "
                                        "(give the link's target, or another path)",
                                        what, path);
        if (!S_ISREG(st.st_mode))
            return moert_set_last_error(MOERT_ERR_IO, "%s %s exists and is not a regular file", what, path);
        for (int i = 0; i < ninputs; i++) {
            struct stat in;
            if (inputs[i] && stat(inputs[i], &in) == 0 && in.st_dev == st.st_dev && in.st_ino == st.st_ino)
                return moert_set_last_error(MOERT_ERR_IO, "%s %s is the input %s: refusing to overwrite an input", what,
                                            path, inputs[i]);
        }
        if (access(path, W_OK) != 0)
            return moert_set_last_error(MOERT_ERR_IO, "%s %s: cannot write it: %s", what, path, strerror(errno));
    } else if (errno != ENOENT) {
        return moert_set_last_error(MOERT_ERR_IO, "%s %s: %s", what, path, strerror(errno));
    }
    /* the temporary file is created in the folder and renamed there */
    folder_of(path, folder, sizeof folder);
    if (stat(folder, &st) != 0)
        return moert_set_last_error(MOERT_ERR_IO, "%s %s: its folder %s: %s", what, path, folder, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return moert_set_last_error(MOERT_ERR_IO, "%s %s: %s is not a folder", what, path, folder);
    if (access(folder, W_OK | X_OK) != 0)
        return moert_set_last_error(MOERT_ERR_IO, "%s %s: cannot write in its folder %s: %s", what, path, folder,
                                    strerror(errno));
    return MOERT_OK;
}

/* realpath of path's folder, then its last name, into buf; false where the folder cannot be resolved. */
static bool resolved_name(const char *path, char *buf, size_t size)
{
    char folder[PATH_MAX], real[PATH_MAX];
    folder_of(path, folder, sizeof folder);
    if (!realpath(folder, real)) return false;
    const char *slash = strrchr(path, '/');
    int n = snprintf(buf, size, "%s/%s", real, slash ? slash + 1 : path);
    return n >= 0 && (size_t)n < size;
}

bool moert_output_same_file(const char *a, const char *b)
{
    if (!a || !b) return false;
    if (!strcmp(a, b)) return true;
    struct stat sa, sb;
    const bool ha = stat(a, &sa) == 0, hb = stat(b, &sb) == 0;
    if (ha && hb) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    char ra[PATH_MAX + NAME_MAX + 2], rb[PATH_MAX + NAME_MAX + 2];
    return resolved_name(a, ra, sizeof ra) && resolved_name(b, rb, sizeof rb) && !strcmp(ra, rb);
}

moert_result moert_output_check_derived(const char *what, const char *path, const char *from, const char *marker,
                                        const char *const *inputs, int ninputs)
{
    moert_result rc = moert_output_check(what, path, inputs, ninputs);
    if (rc != MOERT_OK) return rc;
    FILE *f = fopen(path, "r");
    if (!f) return MOERT_OK; /* not there yet */
    char head[257];
    size_t n = fread(head, 1, sizeof head - 1, f);
    fclose(f);
    head[n] = '\0';
    if (n > 0 && strstr(head, marker)) return MOERT_OK;
    return moert_set_last_error(MOERT_ERR_IO,
                                "%s %s (named after %s) exists and was not written by moert: move it away or choose "
                                "another name",
                                what, path, from);
}

/* The mode a new file gets: 0666 less the umask (read without changing it for good). */
static mode_t new_file_mode(void)
{
    mode_t mask = umask(0);
    umask(mask);
    return 0666 & ~mask;
}

moert_result moert_output_write(const char *path, moert_output_writer write, void *user)
{
    char folder[PATH_MAX], temp[PATH_MAX + 64];
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    folder_of(path, folder, sizeof folder);
    int n = snprintf(temp, sizeof temp, "%s/.%s.tmp-XXXXXX", folder, base);
    if (n < 0 || (size_t)n >= sizeof temp)
        return moert_set_last_error(MOERT_ERR_IO, "writing %s: the path is too long", path);
    int fd = mkstemp(temp);
    if (fd < 0)
        return moert_set_last_error(MOERT_ERR_IO, "writing %s: cannot create a temporary file in %s: %s", path, folder,
                                    strerror(errno));
    /* an existing file keeps its mode; a new one gets what open() would have given it */
    struct stat st;
    mode_t mode = stat(path, &st) == 0 ? (st.st_mode & 07777) : new_file_mode();
    FILE *f = fdopen(fd, "w");
    if (!f) {
        int err = errno;
        close(fd);
        unlink(temp);
        return moert_set_last_error(MOERT_ERR_IO, "writing %s: %s", path, strerror(err));
    }
    errno = 0;
    int failed = write(f, user) != 0;
    int err = errno;
    if (fflush(f) != 0 && !failed) {
        failed = 1;
        err = errno;
    }
    if (!failed && (fchmod(fd, mode) != 0 || fsync(fd) != 0)) {
        failed = 1;
        err = errno;
    }
    if (fclose(f) != 0 && !failed) {
        failed = 1;
        err = errno;
    }
    if (failed) {
        unlink(temp);
        return moert_set_last_error(MOERT_ERR_IO, "writing %s failed (%s); the file was left as it was", path,
                                    err ? strerror(err) : "the writer failed");
    }
    if (rename(temp, path) != 0) {
        err = errno;
        unlink(temp);
        return moert_set_last_error(MOERT_ERR_IO, "writing %s: renaming the temporary file over it: %s", path,
                                    strerror(err));
    }
    return MOERT_OK;
}
