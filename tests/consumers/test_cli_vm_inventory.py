"""The VM inventory (`--vm-inventory`, name,vmId lines) decides which vmId each VM name has
under the signed origin: a file that cannot be read, or a line that is not name,vmId, stops the
service at start with one line saying which and exit status 2, never a traceback and never a
line silently left out."""

from __future__ import annotations

import pytest

from schemas import ConfigError
from schemas.origin import OriginVerifier

from ._refusal import refused


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"web-1,\xff\xfe\n", "is not UTF-8"),
        (b"web-1 11111111-2222-3333-4444-555555555555\n", "line 1: give name,vmId"),
        (b"# name,vmId\n\nweb-1,\nweb-2,b\n", "line 3: give name,vmId"),
        (b",11111111-2222-3333-4444-555555555555\n", "line 1: give name,vmId"),
        (b"web-1,a\nWEB-1,b\n", "line 2: WEB-1 is named on line 1 already"),
        (b'web-1,"a\nb\n', "unexpected end of data"),
        (b"web-1,a\x00\n", "line 1:"),
    ],
)
def test_a_vm_inventory_that_cannot_be_read_is_a_config_error(tmp_path, content, message):
    """The inventory decides which vmId each VM name has. Before, a file that was not UTF-8
    raised UnicodeDecodeError (a traceback at start), and a line that was not name,vmId was
    skipped without a word: the VM it meant to pin was left to the first vmId seen."""
    inventory = tmp_path / "inventory.csv"
    inventory.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as refused:
        OriginVerifier.from_files([], inventory)
    assert str(inventory) in str(refused.value)


def test_a_vm_inventory_with_comments_blank_lines_and_a_byte_order_mark_reads(tmp_path):
    inventory = tmp_path / "inventory.csv"
    inventory.write_bytes(
        "\ufeff# name,vmId\nweb-1, 11111111-AAAA-3333-4444-555555555555\n\n"
        "web-2,22222222-2222-3333-4444-555555555555,extra\nweb-1,11111111-aaaa-3333-4444-555555555555\n".encode()
    )
    assert OriginVerifier.read_inventory(inventory) == {
        "web-1": "11111111-aaaa-3333-4444-555555555555",
        "web-2": "22222222-2222-3333-4444-555555555555",
    }


def test_the_audit_refuses_a_vm_inventory_that_is_not_utf8_in_one_line(tmp_path, capsys):
    inventory = tmp_path / "inventory.csv"
    inventory.write_bytes(b"web-1,\xff\xfe\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("not read: the inventory is refused first\n")
    err = refused(capsys, ["audit", "--broker", "memory://x", "--db", str(tmp_path / "a.db"),
                            "--origin", "signed", "--attestation-ca", str(ca),
                            "--vm-inventory", str(inventory)])  # fmt: skip
    assert err.startswith(f"scheduled-events: the VM inventory {inventory} is not UTF-8")
    assert not (tmp_path / "a.db").exists()  # refused before anything was set up
