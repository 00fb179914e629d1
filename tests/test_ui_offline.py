"""The web page loads with the network cut off: the acceptance item taken literally.

test_ui_browser infers "no external requests" from the DevTools network events: nothing was
asked of anyone but the server. Here the server and the browser run where nothing else can be
reached: a fresh network namespace (``unshare --net``) with loopback up and no other interface
and no route. Whatever the page asked of the world would fail, so the page must still come up
whole: both stages listed (app.js ran and /ui/state answered), its stylesheet applied, no
console error, every URL the server's, and its three files answered 200.

Before the page is opened the run proves the cut is real: loopback is the only interface, the
main routing table is empty, and a connect to a TEST-NET-2 address fails at once with
ENETUNREACH. The connect is tried only once the first two hold, so a run that was not cut off
sends no packet anywhere; it stops there and the test fails on its report.

A namespace belongs to a process, and the server and Chromium must both be in it; so this file
is also the program run inside: the test starts ``unshare --net sh -c 'ip link set lo up &&
exec python THIS_FILE --inside MODEL FOLDER'`` and asserts on the JSON it prints. It needs
root (CI runs as root); without unshare, ip or the rights they need it fails and says why.
"""

from __future__ import annotations

import errno
import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
from _browser import browser_page
from _live_server import LiveServer

from stagerun.server._ui import FILES, page_file

PROBE = ("198.51.100.1", 80)  # TEST-NET-2: no host answers there, and here no route leads there
# the page's files (index.html, app.js, style.css) and the paths the server answers them on
PATHS = {name: "/" if name == "index.html" else f"/ui/{name}" for name in FILES}
READY = (  # both stages listed, and style.css's rules in force (body margin 0, main a grid)
    "document.querySelectorAll('.stage').length === 2"
    " && getComputedStyle(document.body).marginTop === '0px'"
    " && getComputedStyle(document.querySelector('main')).display === 'grid'"
)


def test_the_page_loads_with_the_network_cut_off(tiny_model_path: Path, tmp_path: Path) -> None:
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    assert not missing, f"{missing} not installed: this test needs util-linux and iproute2"
    inner = shlex.join([sys.executable, __file__, "--inside", str(tiny_model_path), str(tmp_path)])
    started = time.monotonic()
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {inner}"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert done.returncode == 0 and done.stdout.strip(), (
        f"the run in a fresh network namespace (unshare --net and ip, which need root) failed"
        f" with exit {done.returncode}: {done.stderr[-3000:]}"
    )
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts["interfaces"] == ["lo"] and facts["routes"] == [], f"not cut off: {facts}"
    assert facts["probe"] == "ENETUNREACH" and facts["probe_ms"] < 1000, f"not cut off: {facts}"
    assert facts["errors"] == [], facts["errors"]
    foreign = [url for url in facts["requested"] if not url.startswith(facts["url"] + "/")]
    assert foreign == [], foreign
    assert facts["statuses"] == dict.fromkeys(PATHS, 200), facts["statuses"]
    sent = sum(facts["transferred"].values())
    size = sum(len(page_file(name)) for name in PATHS)
    print(
        f"\npage offline: {sent} bytes transferred for its {len(PATHS)} files ({size} bytes of"
        f" files; {facts['transferred']}); probe {facts['probe']} in {facts['probe_ms']:.2f}"
        f" ms; {len(facts['requested'])} requests; {seconds:.1f} s in all"
    )


def _cut_off() -> dict[str, Any]:
    """The interfaces, the main routing table's rows and, when those say nothing leaves this
    namespace, what a connect to `PROBE` does (an errno name, and how long it took)."""
    interfaces = sorted(name for _, name in socket.if_nameindex())
    routes = Path("/proc/net/route").read_text().splitlines()[1:]  # below the header
    facts: dict[str, Any] = {"interfaces": interfaces, "routes": routes, "probe": "not tried"}
    if interfaces != ["lo"] or routes:
        return facts
    started = time.perf_counter()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(PROBE)
            facts["probe"] = "connected"
        except TimeoutError:
            facts["probe"] = "timed out"
        except OSError as exc:
            facts["probe"] = errno.errorcode.get(exc.errno or 0, str(exc))
    facts["probe_ms"] = (time.perf_counter() - started) * 1000
    return facts


def _loaded(
    events: list[dict[str, Any]], urls: dict[str, str]
) -> tuple[dict[str, int], dict[str, int]]:
    """Each of the page's files (``urls``: URL -> name) that came back: its status
    (Network.responseReceived) and, once it has finished loading, its bytes on the wire
    (Network.loadingFinished's encodedDataLength: response headers and body)."""
    names: dict[str, str] = {}  # request id -> name
    statuses: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for event in list(events):
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.responseReceived" and params["response"]["url"] in urls:
            names[params["requestId"]] = urls[params["response"]["url"]]
            statuses[names[params["requestId"]]] = params["response"]["status"]
        elif method == "Network.loadingFinished" and params["requestId"] in names:
            sizes[names[params["requestId"]]] = params["encodedDataLength"]
    return statuses, sizes


async def _inside(model: Path, folder: Path) -> dict[str, Any]:
    """Prove the cut, then serve `model` on 2 stages and open the page in headless Chromium;
    what the page did, as plain values for the test to judge."""
    facts = _cut_off()
    if facts["probe"] != "ENETUNREACH":
        return facts
    server = LiveServer(["--model", str(model), "--stages", "2"], folder / "serve.log")
    try:
        await trio.to_thread.run_sync(server.wait_ready)
        async with browser_page() as page:
            await page.call("Page.navigate", url=server.url + "/")
            await page.until(READY)
            urls = {server.url + path: name for name, path in PATHS.items()}
            with trio.fail_after(10):  # the files' loadingFinished events may trail the DOM
                while len(_loaded(page.events, urls)[1]) < len(PATHS):  # noqa: ASYNC110 (CDP)
                    await trio.sleep(0.05)
            statuses, sizes = _loaded(page.events, urls)
            facts |= {"url": server.url, "errors": page.errors(), "requested": page.requested()}
            facts |= {"statuses": statuses, "transferred": sizes}
    finally:
        server.stop()
    return facts


if __name__ == "__main__" and sys.argv[1:2] == ["--inside"]:
    print(json.dumps(trio.run(_inside, Path(sys.argv[2]), Path(sys.argv[3]))))
