"""The periodic log line's step times: per mode, counted and averaged since the last line."""

from moeserve.core.forward_batch import ForwardMode
from moeserve.rank.scheduled_batch import SchedulerStats


def test_step_times_per_mode_then_reset():
    st = SchedulerStats()
    for s in (0.010, 0.012, 0.014):
        st.add_step_time(ForwardMode.DECODE, s)
    st.add_step_time(ForwardMode.EXTEND, 0.030)
    assert st.take_step_times(0.1) == ", steps: decode 3 x 12.0 ms, extend 1 x 30.0 ms (66% of the time)"
    assert st.take_step_times(0.1) == ""
