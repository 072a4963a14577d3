"""gcp-storage-emulator, answering as Cloud Storage does where TensorStore depends on it. Run as a script:
`python tests/gcs_emulator_server.py --host 127.0.0.1 --port N` (tests/gcs_emulator.py starts it).

gcp-storage-emulator 2026.7.19 departs from the JSON API in two ways that Orbax's arrays trip over (they go
through TensorStore's own GCS driver, which reads object generations and makes its writes and cache
revalidations conditional on them; OCDBT's manifest is updated only that way):

1. A media download (`alt=media`, `/download/...`) carries no `x-goog-generation` header. Cloud Storage sends
   it, with `x-goog-metageneration`, `x-goog-stored-content-length`, `x-goog-storage-class` and `x-goog-hash`
   (Google's own GCS testbench, googleapis/storage-testbench `gcs/object.py`, does the same). TensorStore
   reads the generation of every full read from that header (`SetObjectMetadataFromHeaders`); without it the
   generation is 0, which is no valid GCS generation, and the next read that revalidates the cached value
   (`ifGenerationNotMatch=<that generation>`) fails before any request with "Malformed StorageGeneration"
   (`IsValidStorageGeneration` in tensorstore/kvstore/gcs/validate.cc). That is what a 2-process Orbax save
   died of once a step's `manifest.ocdbt` was read twice.
2. Request preconditions (`ifGenerationMatch`, `ifGenerationNotMatch`, `ifMetagenerationMatch`,
   `ifMetagenerationNotMatch`) are ignored: a create-only write (`ifGenerationMatch=0`) replaced an existing
   object, so the conditional writes OCDBT makes its commits with could never conflict. Cloud Storage
   (cloud.google.com/storage/docs/request-preconditions) answers a failed match 412 Precondition Failed and a
   failed not-match 304 Not Modified, and `ifGenerationMatch=0` means "no live object"; the rules here are
   those of the testbench (`make_json_preconditions` in testbench/common.py): on a read, delete or metadata
   patch a missing object is 404 before any precondition; on an upload the preconditions are checked against
   the live object, if any. The emulator processes one request at a time, so a check and the write it
   guards are atomic, as on GCS.

And one way in which it departs from any server: it handles one connection at a time (a plain
`http.server.HTTPServer`, no socket timeout), so one client that connects and then stalls (a process
stopped or blocked between its headers and its body) holds every other client of the emulator up, for
ever; and with socketserver's listen backlog of 5, TensorStore's parallel requests (up to 32 at a time
per process) overflow it and their connections wait out TCP's retransmission back-off (found while looking
for why a CI run's TPU workers hung in their final save; that hang persisted without this). Cloud Storage
serves clients side by side. Here connections are accepted at once (a backlog of 128) and read
concurrently (a thread each), a request's body is read whole before it waits for its turn, the requests
are then processed one at a time as before, a client silent for `CLIENT_TIMEOUT_S` is dropped, and an
upload cut short stores nothing.

Preconditions are honoured on objects.get (metadata and media), objects.insert (media, multipart, and
resumable: at the start and on every chunk, whose upload URL carries them), objects.delete and
objects.patch. The emulator implements none of the source/destination preconditions of copy, rewrite and
compose, so such a request is refused (501) rather than run without its condition.
`tests/test_tpu_torch_gcs.py::test_emulator_behaves_like_gcs_where_checkpoints_care` checks all of this.
"""

from __future__ import annotations

import argparse
import io
import logging
import threading
from functools import partial
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

PRECONDITIONS = ("ifGenerationMatch", "ifGenerationNotMatch", "ifMetagenerationMatch", "ifMetagenerationNotMatch")


def _live(storage, bucket: str, name: str):
    try:
        return storage.get_file_obj(bucket, name)
    except NotFound:
        return None


def failed_precondition(query, obj):
    """The status Cloud Storage answers when a precondition in `query` does not hold for `obj` (the live
    object's resource, None if there is none), or None when they all hold."""
    generation = int(obj["generation"]) if obj else 0
    metageneration = int(obj["metageneration"]) if obj else 0
    for name in PRECONDITIONS:
        if name not in query:
            continue
        want = int(query[name][0])
        have = metageneration if "Metageneration" in name else generation
        if name.endswith("NotMatch"):
            if want == have:  # `NotMatch=0` on a missing object: 0 == 0, not modified
                return HTTPStatus.NOT_MODIFIED
        elif want != have:  # `Match=0`: only when there is no live object
            return HTTPStatus.PRECONDITION_FAILED
    return None


def _refuse(response, status) -> None:
    response.status = status
    if status != HTTPStatus.NOT_MODIFIED:  # a 304 has no body
        response.json({"error": {"code": status.value, "message": f"{status.phrase}: precondition not met"}})


def _on_existing(handler):
    """get / download / delete / patch: 404 for a missing object, then the preconditions."""
    def wrapped(request, response, storage, *args, **kwargs):
        if any(p in request.query for p in PRECONDITIONS):
            obj = _live(storage, request.params["bucket_name"], request.params["object_id"])
            if obj is None:
                response.status = HTTPStatus.NOT_FOUND
                return None
            status = failed_precondition(request.query, obj)
            if status:
                return _refuse(response, status)
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _upload_name(request):
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict):
        return (data.get("meta") or data).get("name")
    return None


def _on_upload(handler, name_of):
    def wrapped(request, response, storage, *args, **kwargs):
        if any(p in request.query for p in PRECONDITIONS):
            name = name_of(request, storage)
            if name is None:
                response.status = HTTPStatus.BAD_REQUEST
                return None
            status = failed_precondition(request.query, _live(storage, request.params["bucket_name"], name))
            if status:
                return _refuse(response, status)
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _resumable_name(request, storage):
    try:
        return storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
    except (NotFound, KeyError):
        return None


def _unconditional_only(handler):
    def wrapped(request, response, storage, *args, **kwargs):
        if any(k.startswith(("if", "ifSource")) and k.endswith("Match") for k in request.query):
            response.status = HTTPStatus.NOT_IMPLEMENTED
            return None
        return handler(request, response, storage, *args, **kwargs)
    return wrapped


def _with_generation_headers(download):
    """Media downloads carry the object's generation headers, as Cloud Storage's do."""
    def wrapped(request, response, storage, *args, **kwargs):
        download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj["metageneration"])
            response["x-goog-stored-content-length"] = str(obj["size"])
            response["x-goog-storage-class"] = obj.get("storageClass") or "STANDARD"
            response[objects._HASH_HEADER] = "crc32c={},md5={}".format(obj["crc32c"], obj["md5Hash"])
    return wrapped


def patch_emulator() -> None:
    download = _on_existing(_with_generation_headers(objects.download))
    wrappers = {
        objects.download: download,
        objects.get: _on_existing(objects.get),  # alt=media goes on to objects.download, patched below
        objects.delete: _on_existing(objects.delete),
        objects.patch: _on_existing(objects.patch),
        objects.insert: _on_upload(objects.insert, lambda request, storage: _upload_name(request)),
        objects.upload_partial: _on_upload(objects.upload_partial, _resumable_name),
        objects.copy: _unconditional_only(objects.copy),
        objects.rewrite: _unconditional_only(objects.rewrite),
        objects.compose: _unconditional_only(objects.compose),
    }
    for _, methods in server.HANDLERS:
        for method, fn in list(methods.items()):
            if fn in wrappers:
                methods[method] = wrappers[fn]
    # looked up at call time: objects.get's media path, and the router's uploads sent without /upload
    objects.download = _with_generation_headers(objects.download)
    objects.insert = wrappers[objects.insert]


CLIENT_TIMEOUT_S = 60  # a client silent this long mid-request is dropped
ONE_AT_A_TIME = threading.Lock()  # requests are processed in turn: a precondition and its write are atomic


def _in_turn(do):
    """A handler method that reads the request's whole body first (this connection's thread; a slow client
    holds no one up), then processes the request when no other is being processed."""
    def wrapped(self):
        try:
            body = server._read_raw_data(self)
        except OSError:  # the client went silent (CLIENT_TIMEOUT_S) or away mid-body
            self.close_connection = True
            return
        expected = self.headers.get("Content-Length")
        if body is not None and expected and len(body) < int(expected):  # cut short: GCS stores nothing of it
            self.close_connection = True
            return
        if body is not None:  # the emulator's handlers read it again, from memory now, at its real length
            del self.headers["Transfer-Encoding"]
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(body))
            self.rfile = io.BytesIO(body)
        with ONE_AT_A_TIME:
            do(self)
    return wrapped


def serve_side_by_side() -> None:
    handler = server.RequestHandler
    handler.timeout = CLIENT_TIMEOUT_S
    for name in ("do_GET", "do_POST", "do_PUT", "do_PATCH", "do_DELETE"):
        setattr(handler, name, _in_turn(getattr(handler, name)))

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # socketserver's 5: TensorStore's parallel writes from 2 workers can overflow it

    def run(api):
        api._httpd = Server((api._host, api._port), partial(handler, api._storage))
        api.is_running.set()
        api._httpd.serve_forever()

    server.APIThread.run = run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    patch_emulator()
    serve_side_by_side()
    server.create_server(args.host, args.port, in_memory=True).run()


if __name__ == "__main__":
    main()
