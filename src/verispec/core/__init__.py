"""The contracts below the engine and the drafters: both depend on this package, never on each other.

sequence.py   a sequence being decoded (`Sequence`) and what one step committed for it (`StepEvent`)
drafter.py    the drafter contract (`Drafter`) and a chain draft (`Draft`)
stopping.py   where a draft chain stops (`DraftStop`, the calibrated acceptance estimate)
adaptation.py what a drafter learns from online (`AdaptExample`, `ExampleBuffer`)
protocols.py  what a runner offers: one pass and one commit over chains and trees (`Runner`), hidden states (`FeatureRunner`)
"""
