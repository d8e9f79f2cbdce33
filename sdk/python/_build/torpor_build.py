"""A minimal PEP 517 build backend, standard library only, so that
``pip install ./sdk/python`` works without fetching setuptools or wheel (torpor
hosts and sandboxes often have no package index). It builds a pure-Python wheel
of the ``torpor`` package and an sdist."""

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TAG = "py3-none-any"


def _project():
    with open(os.path.join(_ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    proj = text.split("[project]", 1)[1].split("\n[", 1)[0]

    def field(name):
        m = re.search(r'^%s\s*=\s*"([^"]*)"' % name, proj, re.M)
        return m.group(1) if m else ""
    return field("name"), field("version"), field("description"), field("requires-python")


def _package_files():
    out = []
    pkg = os.path.join(_ROOT, "torpor")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            out.append(("torpor/" + name, os.path.join(pkg, name)))
    return out


def _metadata():
    name, version, summary, requires = _project()
    lines = ["Metadata-Version: 2.1", "Name: " + name, "Version: " + version, "Summary: " + summary]
    if requires:
        lines.append("Requires-Python: " + requires)
    readme = os.path.join(_ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as f:
            body = "\n" + f.read()
    return ("\n".join(lines) + "\n" + body).encode("utf-8")


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def _dist_info():
    name, version, _, _ = _project()
    return name, version, "%s-%s.dist-info" % (name, version)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _, _, di = _dist_info()
    d = os.path.join(metadata_directory, di)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "wb") as f:
        f.write(_metadata())
    with open(os.path.join(d, "WHEEL"), "wb") as f:
        f.write(_wheel_file())
    return di


def _wheel_file():
    return ("Wheel-Version: 1.0\nGenerator: torpor_build\nRoot-Is-Purelib: true\nTag: %s\n" % _TAG).encode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name, version, di = _dist_info()
    fname = "%s-%s-%s.whl" % (name, version, _TAG)
    records = []

    def add(zf, arc, data):
        zf.writestr(zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0)), data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append("%s,sha256=%s,%d" % (arc, digest, len(data)))

    with zipfile.ZipFile(os.path.join(wheel_directory, fname), "w", zipfile.ZIP_DEFLATED) as zf:
        for arc, path in _package_files():
            with open(path, "rb") as f:
                add(zf, arc, f.read())
        add(zf, di + "/METADATA", _metadata())
        add(zf, di + "/WHEEL", _wheel_file())
        add(zf, di + "/top_level.txt", b"torpor\n")
        records.append(di + "/RECORD,,")
        zf.writestr(zipfile.ZipInfo(di + "/RECORD", date_time=(2020, 1, 1, 0, 0, 0)),
                    ("\n".join(records) + "\n").encode())
    return fname


def build_sdist(sdist_directory, config_settings=None):
    name, version, _ = _dist_info()
    base = "%s-%s" % (name, version)
    fname = base + ".tar.gz"
    files = [("pyproject.toml", os.path.join(_ROOT, "pyproject.toml")),
             ("README.md", os.path.join(_ROOT, "README.md")),
             ("_build/torpor_build.py", os.path.abspath(__file__))] + _package_files()
    with tarfile.open(os.path.join(sdist_directory, fname), "w:gz", format=tarfile.PAX_FORMAT) as tf:
        for arc, path in files:
            if os.path.exists(path):
                with open(path, "rb") as f:
                    data = f.read()
                ti = tarfile.TarInfo(base + "/" + arc)
                ti.size = len(data)
                ti.mode = 0o644
                tf.addfile(ti, io.BytesIO(data))
        pkg = _metadata()
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(pkg)
        ti.mode = 0o644
        tf.addfile(ti, io.BytesIO(pkg))
    return fname
