"""junit.xml: one testcase per cell, for CI systems that read JUnit: a new failure's message is
its signature, its body the cell's message and traceback."""

from __future__ import annotations

from xml.etree import ElementTree


def junit_xml(document: dict) -> bytes:
    cells = document["cells"]
    suite = ElementTree.Element(
        "testsuite",
        name="precision-matrix",
        tests=str(len(cells)),
        failures=str(document["counts"]["failed"]),
        skipped=str(document["counts"]["skipped"] + document["counts"]["known"]),
        errors="0",
        time=f"{sum(c['duration_s'] for c in cells):.3f}",
    )
    for cell in cells:
        case = ElementTree.SubElement(
            suite,
            "testcase",
            classname=f"matrix.{cell['device']}.{cell['engine']}.{cell['mode']}",
            name=cell["id"],
            time=f"{cell['duration_s']:.3f}",
        )
        if cell["outcome"] == "known":
            ElementTree.SubElement(
                case, "skipped", type="pytest.xfail", message=f"known: {cell['known_failure']['id']}"
            )
        elif cell["outcome"] == "failed":
            failure = ElementTree.SubElement(
                case, "failure", message=f"{cell['signature']['id']} {cell['signature']['text']}"
            )
            failure.text = failure_body(cell)
        elif cell["outcome"] == "skipped":
            ElementTree.SubElement(case, "skipped", message=cell["skip_reason"] or "")
    return ElementTree.tostring(suite, encoding="utf-8", xml_declaration=True)


def failure_body(cell: dict) -> str:
    """The message, then the traceback (a crash's message holds its stacks already: once)."""
    message, traceback = cell["message"] or "", cell.get("traceback")
    if not traceback or traceback in message:
        return message
    return f"{message}\n\n{traceback}" if message else traceback
