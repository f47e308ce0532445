"""bench/slim_ray_wheel.py drops Ray's unused libraries and their RECORD lines, and keeps everything else."""

import zipfile



def _wheel(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ray/_raylet.so", b"binary")
        z.writestr("ray/util/placement_group.py", b"pg")
        z.writestr("ray/rllib/algo.py", b"x")
        z.writestr("ray/data/dataset.py", b"x")
        z.writestr("ray/train/trainer.py", b"x")
        z.writestr("ray-2.60.0.dist-info/RECORD",
                   "ray/_raylet.so,sha256=a,6\nray/util/placement_group.py,sha256=b,2\nray/rllib/algo.py,sha256=c,1\n"
                   "ray/data/dataset.py,sha256=d,1\nray/train/trainer.py,sha256=e,1\n")
    return path


def test_unused_libraries_and_their_records_go(tmp_path, script):
    wheel = _wheel(tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl")
    done = script("slim_ray_wheel", str(tmp_path))
    assert done.returncode == 0 and wheel.name in done.stdout, done.stdout + done.stderr
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode().splitlines()
        assert z.read("ray/_raylet.so") == b"binary"
    assert names == {"ray/_raylet.so", "ray/util/placement_group.py", "ray-2.60.0.dist-info/RECORD"}
    assert record == ["ray/_raylet.so,sha256=a,6", "ray/util/placement_group.py,sha256=b,2"]
    assert list(tmp_path.iterdir()) == [wheel]  # no temporary file left beside it


def test_an_empty_wheelhouse_is_reported(tmp_path, script):
    done = script("slim_ray_wheel", str(tmp_path))
    assert done.returncode == 2 and "no ray-*.whl" in done.stdout
