"""Reads OTLP profiles export requests (files of protobuf, as an OTLP/HTTP
receiver got them, gunzipped) with the OpenTelemetry proto package as
published for Python (PyPI's opentelemetry-proto), independently of the
Rust messages slotprof encodes with, and prints their samples: one JSON
line per (slot, profile type, stack, labels) with its summed value, the
stack's functions (or address@mapping for an unnamed frame) leaf first as
they come, the labels as key=value[unit], sorted.

Usage: python otlp_content.py REQUEST...
"""

import json
import sys

from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)


def samples(request):
    d = request.dictionary
    s = d.string_table
    if s[0] != "" or d.stack_table[0].location_indices:
        raise SystemExit("the dictionary's zero entries are not zero")
    for rp in request.resource_profiles:
        for sp in rp.scope_profiles:
            for p in sp.profiles:
                kind = s[p.sample_type.type_strindex] + "/" + s[p.sample_type.unit_strindex]
                for sample in p.samples:
                    stack = []
                    for li in d.stack_table[sample.stack_index].location_indices:
                        loc = d.location_table[li]
                        if not loc.lines:
                            m = d.mapping_table[loc.mapping_index]
                            stack.append("%#x@%s" % (loc.address, s[m.filename_strindex]))
                        for line in loc.lines:
                            stack.append(s[d.function_table[line.function_index].name_strindex])
                    slot, labels = -1, []
                    for ai in sample.attribute_indices:
                        a = d.attribute_table[ai]
                        key, which = s[a.key_strindex], a.value.WhichOneof("value")
                        if which == "string_value":
                            value = a.value.string_value
                        elif which == "int_value":
                            value = str(a.value.int_value)
                            if key == "slot":
                                slot = a.value.int_value
                        else:
                            raise SystemExit("attribute %s holds a %s" % (key, which))
                        unit = s[a.unit_strindex]
                        labels.append("%s=%s[%s]" % (key, value, unit) if unit else "%s=%s" % (key, value))
                    labels.sort()
                    if len(sample.values) != 1:
                        raise SystemExit("a sample with %d values" % len(sample.values))
                    yield (slot, kind, stack, labels), sample.values[0]


def main():
    content = {}
    for path in sys.argv[1:]:
        request = ExportProfilesServiceRequest()
        with open(path, "rb") as f:
            request.ParseFromString(f.read())
        for key, value in samples(request):
            k = json.dumps(key)
            content[k] = content.get(k, 0) + value
    for k, v in content.items():
        print(json.dumps([json.loads(k), v]))


main()
