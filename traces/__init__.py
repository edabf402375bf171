"""traces: the trace tools (readers, the overlap analyzer, timelines, `capture`).

Import them from their modules (`traces.analyze.analyze`, `traces.readers.read_trace`,
`traces.model.Trace`, `traces.capture.capture`, ...). The phase ranges that a step opens
are the runtime's (`dbo.ranges`, re-exported by `dbo`): this package only reads them back.
"""
