"""Device smoke check: ComfyUI's main.py start-up (DynamicVRAM as users get it) and the pack's nodes load."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import comfy_tree  # noqa: E402

fe = tempfile.mkdtemp()
cmd = comfy_tree.main_py_command(["--quick-test-for-ci", "--disable-api-nodes", "--front-end-root", fe,
                                  "--listen", "127.0.0.1", "--port", "8931"])
r = subprocess.run(cmd, cwd=comfy_tree.COMFY_ROOT, capture_output=True, text=True, timeout=300)
print("rc", r.returncode)
print(r.stdout[-4000:])
print(r.stderr[-6000:])
